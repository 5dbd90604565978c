// NF4 -> bf16 dequantization on the GPU, run once per NF4 linear layer in every forward
// and backward (QLoRA's frozen base, NOTE [NF4 storage] in ops/nf4.h):
//   absmax[b] = dynamic[absmax_codes[b]] * absmax_scales[b / 256] + absmax_offset
//   out[i]    = nf4[code(i)] * absmax[i / 64]
// Memory-bound: 0.5 byte read and 2 bytes written per weight, plus a byte of statistics
// per 64 weights. Each thread takes 16 consecutive weights (one 8-byte load of codes, two
// 16-byte stores), all in one 64-weight block, so it rebuilds its block's absmax once.
// The code tables and the absmax come from nf4_device.cuh; the fp32 product is rounded to
// nearest-even bf16, which makes the output bitwise the CPU reference's and bitsandbytes'
// dequantize_4bit.
// Assumes nothing about n: a thread whose 16 weights run past n, or a buffer not aligned
// for vector access, takes the scalar path.
#include "kernels/cuda/nf4.h"

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/nf4_device.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPerThread = 16;

__global__ void nf4_dequantize_kernel(bf16* out, const uint8_t* codes, const uint8_t* absmax_codes,
                                      const float* absmax_scales, float absmax_offset, int64_t n,
                                      Nf4CodeTables tables, bool vector_ok) {
  __shared__ float nf4[16];
  __shared__ float dynamic[256];
  nf4_stage_tables(tables, nf4, dynamic);

  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread;
  if (first >= n) return;
  const int64_t block = first / 64;
  const float absmax = nf4_block_absmax(dynamic, absmax_codes, absmax_scales, absmax_offset, block);
  if (vector_ok && first + kPerThread <= n) {
    const uint2 packed = *reinterpret_cast<const uint2*>(codes + first / 2);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(&packed);
    uint4 halves[2];
    bf16* values = reinterpret_cast<bf16*>(halves);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      values[2 * k] = __float2bfloat16_rn(__fmul_rn(nf4[bytes[k] >> 4], absmax));
      values[2 * k + 1] = __float2bfloat16_rn(__fmul_rn(nf4[bytes[k] & 0x0f], absmax));
    }
    reinterpret_cast<uint4*>(out + first)[0] = halves[0];
    reinterpret_cast<uint4*>(out + first)[1] = halves[1];
    return;
  }
  for (int64_t i = first; i < n && i < first + kPerThread; ++i) {
    const uint8_t byte = codes[i / 2];
    const int nibble = i % 2 ? byte & 0x0f : byte >> 4;
    out[i] = __float2bfloat16_rn(__fmul_rn(nf4[nibble], absmax));
  }
}

}  // namespace

void nf4_dequantize(bf16* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales,
                    float absmax_offset, int64_t n) {
  if (n == 0) return;
  static const Nf4CodeTables tables = nf4_code_tables();
  const bool vector_ok = reinterpret_cast<uintptr_t>(out) % 16 == 0 && reinterpret_cast<uintptr_t>(codes) % 8 == 0;
  const int64_t threads = (n + kPerThread - 1) / kPerThread;
  const auto blocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  nf4_dequantize_kernel<<<blocks, kThreads>>>(out, codes, absmax_codes, absmax_scales, absmax_offset, n, tables,
                                              vector_ok);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
