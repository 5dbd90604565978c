// Eight bf16 values in one 16-byte word (uint4): the unit the vectorized kernels load and
// store, converted to and from fp32 two at a time. Device code only.
#pragma once

#include "kernels/cuda/types.h"

namespace forge::cuda {

__device__ __forceinline__ void unpack8(uint4 raw, float (&out)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  return raw;
}

}  // namespace forge::cuda
