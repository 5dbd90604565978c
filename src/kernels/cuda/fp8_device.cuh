// Device pieces every kernel that writes FP8 codes or an amax shares: the saturating
// cast, the amax as integer bits, the block's maximum folded into one device float, and
// the epilogue a producer kernel runs on its output (kernels/cuda/fp8_epilogue.h). Device
// code only; fp8_cast.cu says why each is done so (NOTE [FP8 scaling recipes] in
// kernels/cpu/fp8_scaling.h is the reference).
#pragma once

#include <cuda_fp8.h>

#include "kernels/cpu/fp8.h"
#include "kernels/cuda/fp8_epilogue.h"
#include "kernels/cuda/types.h"

namespace forge::cuda {

using cpu::Fp8Format;

template <Fp8Format F>
__device__ __forceinline__ uint8_t cast_saturated(float v) {
  if (isnan(v)) return signbit(v) ? 0xff : 0x7f;
  constexpr float top = F == Fp8Format::E4M3 ? cpu::kFp8E4M3Max : cpu::kFp8E5M2Max;
  v = fminf(fmaxf(v, -top), top);  // torchao's clamp; infinities included, whatever the instruction does with them
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, F == Fp8Format::E4M3 ? __NV_E4M3 : __NV_E5M2));
}

// torchao's amax_to_scale: float64 division, rounded to fp32; the power of 2 below it
// through an fp32 log2 (see the CPU reference). Every kernel that turns an amax into a
// scale calls this, so their scales are the same bits.
__device__ __forceinline__ float scale_from_amax(float a, float fp8_max, bool power_of_2) {
  const double clamped = isnan(a) ? static_cast<double>(a) : fmax(static_cast<double>(a), 1e-12);
  float s = static_cast<float>(static_cast<double>(fp8_max) / clamped);
  if (power_of_2) s = exp2f(floorf(static_cast<float>(log2(static_cast<double>(s)))));
  return s;
}

// |v| as the bits of a non-negative float: orders as unsigned, NaN above +inf.
__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(v) & 0x7fffffffu; }

// A thread's share of an elementwise pass over x[0, n): the kFp8Vector = 8 elements from
// `first` (fewer at the end), one 16-byte load when `vector_ok` (x 16-byte aligned, out
// 8-byte aligned) and all 8 are there, one at a time otherwise. amax8 folds their |x| into
// `mine`; cast8 also writes their codes with `scale` to out[first, ...) (fp8_cast.cu says
// why each step is done so). fp8_cast's and the grouped casts' kernels share them.
constexpr int64_t kFp8Vector = 8;

__device__ __forceinline__ void amax8(const bf16* x, int64_t first, int64_t n, bool vector_ok, unsigned& mine) {
  if (vector_ok && first + kFp8Vector <= n) {
    const uint4 packed = *reinterpret_cast<const uint4*>(x + first);
    const bf16* values = reinterpret_cast<const bf16*>(&packed);
#pragma unroll
    for (int k = 0; k < kFp8Vector; ++k) mine = max(mine, abs_bits(__bfloat162float(values[k])));
  } else {
    for (int64_t i = first; i < n && i < first + kFp8Vector; ++i) mine = max(mine, abs_bits(__bfloat162float(x[i])));
  }
}

template <Fp8Format F>
__device__ __forceinline__ void cast8(const bf16* x, int64_t first, int64_t n, float scale, uint8_t* out,
                                      bool vector_ok, unsigned& mine) {
  if (vector_ok && first + kFp8Vector <= n) {
    const uint4 packed = *reinterpret_cast<const uint4*>(x + first);
    const bf16* values = reinterpret_cast<const bf16*>(&packed);
    uint2 codes;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(&codes);
#pragma unroll
    for (int k = 0; k < kFp8Vector; ++k) {
      const float v = __bfloat162float(values[k]);
      mine = max(mine, abs_bits(v));
      bytes[k] = cast_saturated<F>(__fmul_rn(v, scale));
    }
    *reinterpret_cast<uint2*>(out + first) = codes;
  } else {
    for (int64_t i = first; i < n && i < first + kFp8Vector; ++i) {
      const float v = __bfloat162float(x[i]);
      mine = max(mine, abs_bits(v));
      out[i] = cast_saturated<F>(__fmul_rn(v, scale));
    }
  }
}

// The block's largest `mine`, atomically folded into *amax (as unsigned bits). Every thread
// of the block calls it; blockDim.x is a multiple of 32, at most 1024.
__device__ __forceinline__ void block_max_into(unsigned mine, float* amax) {
  __shared__ unsigned warp_max[32];
  mine = __reduce_max_sync(0xffffffffu, mine);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  if (lane == 0) warp_max[warp] = mine;
  __syncthreads();
  if (warp == 0) {
    mine = lane < warps ? warp_max[lane] : 0u;
    mine = __reduce_max_sync(0xffffffffu, mine);
    if (lane == 0 && mine != 0u) atomicMax(reinterpret_cast<unsigned*>(amax), mine);
  }
}

// NOTE [FP8 fused producers] in ops/fp8_linear.h: the epilogue of a kernel writing 8
// consecutive bf16 outputs `out` (already rounded) at element `at` of its output: their
// amax into `mine`, and with e.codes their E4M3 codes (8 bytes) at e.codes + at.
__device__ __forceinline__ void fp8_epilogue8(const Fp8Epilogue& e, uint4 out, int64_t at, unsigned& mine) {
  const bf16* values = reinterpret_cast<const bf16*>(&out);
  uint2 codes;
  uint8_t* bytes = reinterpret_cast<uint8_t*>(&codes);
  const float scale = e.codes ? *e.scale : 0.0f;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float v = __bfloat162float(values[k]);
    mine = max(mine, abs_bits(v));
    if (e.codes) bytes[k] = cast_saturated<Fp8Format::E4M3>(__fmul_rn(v, scale));
  }
  if (e.codes) *reinterpret_cast<uint2*>(e.codes + at) = codes;
}

}  // namespace forge::cuda
