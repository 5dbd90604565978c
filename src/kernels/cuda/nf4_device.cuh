// Device pieces the NF4 kernels share (nf4.cu's dequantization, nf4_fp8.cu's casts straight
// to E4M3): the two code tables, passed by value and staged in shared memory (a warp's
// nibbles index them at random), and one block's absmax rebuilt from its double-quantized
// statistics (NOTE [NF4 storage] in ops/nf4.h), every product and sum rounded on its own
// (__fmul_rn, __fadd_rn: no fused multiply-add), as the CPU reference and bitsandbytes do.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "kernels/cpu/nf4.h"

namespace forge::cuda {

struct Nf4CodeTables {
  float nf4[16];
  float dynamic[256];
};

inline Nf4CodeTables nf4_code_tables() {
  Nf4CodeTables tables;
  for (int i = 0; i < 16; ++i) tables.nf4[i] = cpu::kNf4Code[i];
  for (int i = 0; i < 256; ++i) tables.dynamic[i] = cpu::kDynamicCode[i];
  return tables;
}

// The tables into the block's shared copies; every thread of the block calls it.
__device__ __forceinline__ void nf4_stage_tables(const Nf4CodeTables& tables, float* nf4, float* dynamic) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) dynamic[i] = tables.dynamic[i];
  if (threadIdx.x < 16) nf4[threadIdx.x] = tables.nf4[threadIdx.x];
  __syncthreads();
}

// The absmax of block `block` of 64 weights.
__device__ __forceinline__ float nf4_block_absmax(const float* dynamic, const uint8_t* absmax_codes,
                                                  const float* absmax_scales, float absmax_offset, int64_t block) {
  return __fadd_rn(__fmul_rn(dynamic[absmax_codes[block]], absmax_scales[block / 256]), absmax_offset);
}

// Weight i's value rounded to bf16, as a float: nf4[code(i)] * absmax, element 2i in the
// high nibble of byte i.
__device__ __forceinline__ float nf4_weight(const float* nf4, uint8_t byte, bool high, float absmax) {
  return __bfloat162float(__float2bfloat16_rn(__fmul_rn(nf4[high ? byte >> 4 : byte & 0x0f], absmax)));
}

}  // namespace forge::cuda
