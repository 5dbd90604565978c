// An FSDP rank's own chunk of an FP8 weight, cast to E4M3 before the all-gather (NOTE [FP8
// all-gather] in distributed/fsdp.h), and the byte transpose the gathered codes need.
//
// Chunk amax and cast: the bf16-gather path casts the fp32 master chunk to bf16, gathers,
// then takes the weight's amax and casts bf16 * scale to E4M3 (fp8_cast.cu). These kernels
// read the fp32 master directly and round each value to bf16 in registers (__float2bfloat16,
// round to nearest even, what the gather's cast writes), then do exactly what amax_kernel
// and cast_kernel do with that bf16 value: the amax as unsigned bits (NaN above +inf), the
// product rounded once (__fmul_rn) and the saturating cast of fp8_device.cuh. So the codes
// are the bf16 path's bit for bit, and the chunk is read once, 4 bytes in and 1 byte out
// per element, with no bf16 staging. One thread per 4 consecutive elements (a 16-byte load
// when aligned, a 4-byte store), a grid-stride loop for the amax. The scales of a block's
// projections come from one tiny kernel over their max-reduced amaxes, through the same
// scale_from_amax as fp8_scale_from_amax. Every launch takes the stream it is given: the
// FSDP gathers run on the communication stream.
//
// Byte transpose: the input gradient's GEMM needs W^T's codes (NOTE [FP8 GEMM layout] in
// kernels/cuda/fp8_matmul.h); the forward's codes are gathered, so W^T is their transpose.
// A block owns a 32x32 tile, read row by row into shared memory (33 bytes a row, so that
// the column reads do not all hit one bank) and written out as columns; tiles at the edges
// are partial. Memory-bound, 1 byte read and 1 written per element.
#include "kernels/cuda/fp8_weight_chunk.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fp8_device.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPerThread = 4;
constexpr int kTile = 32;

__device__ __forceinline__ float as_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>(std::max<int64_t>((n + kThreads * kPerThread - 1) / (kThreads * kPerThread), 1));
}

__global__ void chunk_amax_kernel(const float* x, int64_t n, float* amax) {
  unsigned mine = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kPerThread;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread; first < n;
       first += stride)
    for (int64_t i = first; i < n && i < first + kPerThread; ++i) mine = max(mine, abs_bits(as_bf16(x[i])));
  block_max_into(mine, amax);
}

__global__ void chunk_scales_kernel(const float* amax, int64_t count, float* scale, float* scale_inv, int64_t stride) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= count) return;
  const float s = scale_from_amax(amax[k], cpu::kFp8E4M3Max, false);
  scale[k * stride] = s;
  scale_inv[k * stride] = 1.0f / s;
}

__global__ void chunk_cast_kernel(const float* x, int64_t n, const float* scale_ptr, uint8_t* out, float* amax,
                                  bool vector_ok) {
  const float scale = *scale_ptr;
  unsigned mine = 0;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread;
  if (first < n) {
    if (vector_ok && first + kPerThread <= n) {
      const float4 v4 = *reinterpret_cast<const float4*>(x + first);
      const float values[kPerThread] = {v4.x, v4.y, v4.z, v4.w};
      uint32_t codes;
      uint8_t* bytes = reinterpret_cast<uint8_t*>(&codes);
#pragma unroll
      for (int k = 0; k < kPerThread; ++k) {
        const float v = as_bf16(values[k]);
        mine = max(mine, abs_bits(v));
        bytes[k] = cast_saturated<Fp8Format::E4M3>(__fmul_rn(v, scale));
      }
      *reinterpret_cast<uint32_t*>(out + first) = codes;
    } else {
      for (int64_t i = first; i < n && i < first + kPerThread; ++i) {
        const float v = as_bf16(x[i]);
        mine = max(mine, abs_bits(v));
        out[i] = cast_saturated<Fp8Format::E4M3>(__fmul_rn(v, scale));
      }
    }
  }
  if (amax) block_max_into(mine, amax);
}

__global__ void fold_amax_kernel(const float* amax, float* seen) {
  atomicMax(reinterpret_cast<unsigned*>(seen), abs_bits(*amax));
}

__global__ void transpose_codes_kernel(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int r = threadIdx.y; r < kTile; r += blockDim.y) {
    const int64_t row = row0 + r, col = col0 + threadIdx.x;
    if (row < rows && col < cols) tile[r][threadIdx.x] = in[row * cols + col];
  }
  __syncthreads();
  for (int c = threadIdx.y; c < kTile; c += blockDim.y) {
    const int64_t col = col0 + c, row = row0 + threadIdx.x;
    if (row < rows && col < cols) out[col * rows + row] = tile[threadIdx.x][c];
  }
}

}  // namespace

void fp8_chunk_amax(const float* x, int64_t n, float* amax, CudaStream stream) {
  CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  if (n == 0) return;
  chunk_amax_kernel<<<std::min(blocks_for(n), 132u * 16u), kThreads, 0, stream>>>(x, n, amax);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_chunk_scales(const float* amax, int64_t count, float* scale, float* scale_inv, int64_t stride,
                      CudaStream stream) {
  if (count == 0) return;
  const unsigned blocks = static_cast<unsigned>((count + kThreads - 1) / kThreads);
  chunk_scales_kernel<<<blocks, kThreads, 0, stream>>>(amax, count, scale, scale_inv, stride);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_chunk_cast(const float* x, int64_t n, const float* scale, uint8_t* out, float* amax, CudaStream stream) {
  if (n == 0) return;
  const bool vector_ok = aligned(x, 16) && aligned(out, 4);
  chunk_cast_kernel<<<blocks_for(n), kThreads, 0, stream>>>(x, n, scale, out, amax, vector_ok);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_fold_amax(const float* amax, float* seen, CudaStream stream) {
  fold_amax_kernel<<<1, 1, 0, stream>>>(amax, seen);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_transpose_codes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, CudaStream stream) {
  if (rows == 0 || cols == 0) return;
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  transpose_codes_kernel<<<grid, dim3(kTile, 8), 0, stream>>>(in, rows, cols, out);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
