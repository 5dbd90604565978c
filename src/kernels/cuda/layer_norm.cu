// Affine LayerNorm on the GPU, forward only: bf16 rows, weight and bias, fp32 statistics.
//
// One warp per row, eight rows to a block of 256 threads, as the modulated LayerNorm's
// forward (modulated_layer_norm.cu): lane l holds the 16-byte vectors (8 bf16) l, l + 32,
// ... of the row, so every load is 16 bytes wide and a warp's loads are coalesced. Three
// passes over the row: the sum (-> mean), the sum of squared deviations from that mean
// (-> rstd: the two-pass variance, which a large mean does not spoil the way E[x^2] -
// mean^2 would in fp32), and the output y = (x - mean) rstd weight + bias. The row (1.5 KB
// at CLIP-L's 768) is read from device memory once; the later passes find it in L1 or L2.
// Each row sum is a butterfly of shuffles. Every lane has read its vectors for the
// statistics before any lane writes y, and a lane writes only the vectors it read, so y
// may be x.
//
// Assumes dim is a multiple of 8 and 16-byte aligned tensors; checked.
#include "kernels/cuda/layer_norm.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kRowThreads = 256;  // a warp per row: 8 rows per block

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void __launch_bounds__(kRowThreads)
    forward_kernel(bf16* y, const bf16* x, const bf16* __restrict__ weight, const bf16* __restrict__ bias,
                   int64_t rows, int dim, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / kWarp) + threadIdx.x / kWarp;
  if (row >= rows) return;  // the whole warp leaves: no shuffle below misses a lane
  const int lane = threadIdx.x % kWarp, vectors = dim / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(x) + row * vectors;

  float sum = 0.f;
  for (int c = lane; c < vectors; c += kWarp) {
    float f[8];
    unpack8(xr[c], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) sum += f[k];
  }
  const float m = warp_sum(sum) / dim;
  float squares = 0.f;
  for (int c = lane; c < vectors; c += kWarp) {
    float f[8];
    unpack8(xr[c], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) squares += (f[k] - m) * (f[k] - m);
  }
  const float r = rsqrtf(warp_sum(squares) / dim + eps);

  const uint4* w = reinterpret_cast<const uint4*>(weight);
  const uint4* b = reinterpret_cast<const uint4*>(bias);
  uint4* yr = reinterpret_cast<uint4*>(y) + row * vectors;
  for (int c = lane; c < vectors; c += kWarp) {
    float f[8], wf[8], bf[8];
    unpack8(xr[c], f);
    unpack8(w[c], wf);
    unpack8(b[c], bf);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = (f[k] - m) * r * wf[k] + bf[k];
    yr[c] = pack8(f);
  }
}

}  // namespace

void layer_norm_forward(bf16* y, const bf16* x, const bf16* weight, const bf16* bias, int64_t rows, int64_t dim,
                        float eps) {
  FORGE_CHECK(dim > 0 && dim % 8 == 0 && dim <= std::numeric_limits<int>::max(),
              "layer_norm_forward: dim {} must be a positive multiple of 8 on CUDA", dim);
  for (const auto& [pointer, what] : {std::pair<const void*, const char*>{y, "y"}, {x, "x"}, {weight, "weight"},
                                      {bias, "bias"}})
    FORGE_CHECK(reinterpret_cast<uintptr_t>(pointer) % 16 == 0,
                "layer_norm_forward: {} must be 16-byte aligned on CUDA", what);
  if (rows == 0) return;
  constexpr int per_block = kRowThreads / kWarp;
  forward_kernel<<<static_cast<unsigned>((rows + per_block - 1) / per_block), kRowThreads>>>(
      y, x, weight, bias, rows, static_cast<int>(dim), eps);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
