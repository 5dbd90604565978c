// Modulated LayerNorm (adaLN) on the GPU: bf16 activations and modulation, fp32 statistics.
//
// Forward: one warp per row (b, t), eight rows to a block of 256 threads. Lane l holds the
// 16-byte vectors (8 bf16) l, l + 32, ... of the row, so every load is 16 bytes wide and a
// warp's loads are coalesced. Three passes over the row: the sum (-> mean), the sum of
// squared deviations from that mean (-> rstd: the two-pass variance, which a large mean
// does not spoil the way E[x^2] - mean^2 would in fp32), and the output
//   y = (x - mean) rstd (1 + scale[b]) + shift[b].
// The row (6 KB at FLUX's dim 3072) is read from device memory once; the second and third
// passes find it in L1 or L2. Each row sum is a butterfly of shuffles.
//
// Backward, two kernels, neither with float atomics:
//  1. dx, one warp per row as above: with g = dy (1 + scale[b]) and xhat = (x - mean) rstd,
//       dx += rstd (g - mean_d(g) - xhat mean_d(g xhat))                    (ACCUMULATED)
//     one pass for the two row sums, one to read the old dx and write the new one.
//  2. dshift[b,d] = sum_t dy, dscale[b,d] = sum_t dy xhat (overwritten): a block owns 16
//     columns (2 vectors) of one sample and its 128 token lanes walk t = lane, lane + 128,
//     ... (one 32-byte sector per row and vector pair: full sectors), summing in fp32 in
//     registers. The lanes' sums meet in a shuffle butterfly within each warp and then the
//     warps' sums are added in warp order from shared memory; the result is rounded to bf16
//     once. The partition depends on the shapes only, so the bits are the same every run.
//     Kernel 2 reads dy and x a second time; it has B * dim / 16 blocks (192 at FLUX's
//     dim 3072 with B = 1), enough to cover an H100's 132 SMs.
//
// Assumes dim is a multiple of 8 (FLUX's 3072 is) and 16-byte aligned tensors; checked.
#include "kernels/cuda/modulated_layer_norm.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kRowThreads = 256;                          // a warp per row: 8 rows per block
constexpr int kSumVectors = 2;                            // 16-byte vectors (16 columns) per block of the sums
constexpr int kSumLanes = 128;                            // threads walking the tokens of each vector
constexpr int kSumWarps = kSumVectors * kSumLanes / kWarp;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void __launch_bounds__(kRowThreads)
    forward_kernel(bf16* __restrict__ y, float* __restrict__ mean, float* __restrict__ rstd,
                   const bf16* __restrict__ x, const bf16* __restrict__ shift, const bf16* __restrict__ scale,
                   int64_t rows, int64_t tokens, int dim, float eps) {
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
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }

  const int64_t sample = row / tokens * vectors;
  const uint4* sh = reinterpret_cast<const uint4*>(shift) + sample;
  const uint4* sc = reinterpret_cast<const uint4*>(scale) + sample;
  uint4* yr = reinterpret_cast<uint4*>(y) + row * vectors;
  for (int c = lane; c < vectors; c += kWarp) {
    float f[8], s[8], h[8];
    unpack8(xr[c], f);
    unpack8(sc[c], s);
    unpack8(sh[c], h);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = (f[k] - m) * r * (1.f + s[k]) + h[k];
    yr[c] = pack8(f);
  }
}

__global__ void __launch_bounds__(kRowThreads)
    backward_dx_kernel(bf16* __restrict__ dx, const bf16* __restrict__ dy, const bf16* __restrict__ x,
                       const bf16* __restrict__ scale, const float* __restrict__ mean,
                       const float* __restrict__ rstd, int64_t rows, int64_t tokens, int dim) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (kRowThreads / kWarp) + threadIdx.x / kWarp;
  if (row >= rows) return;
  const int lane = threadIdx.x % kWarp, vectors = dim / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(x) + row * vectors;
  const uint4* dyr = reinterpret_cast<const uint4*>(dy) + row * vectors;
  const uint4* sc = reinterpret_cast<const uint4*>(scale) + row / tokens * vectors;
  uint4* dxr = reinterpret_cast<uint4*>(dx) + row * vectors;
  const float m = mean[row], r = rstd[row];

  float sum_g = 0.f, sum_gx = 0.f;
  for (int c = lane; c < vectors; c += kWarp) {
    float fx[8], fy[8], s[8];
    unpack8(xr[c], fx);
    unpack8(dyr[c], fy);
    unpack8(sc[c], s);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float g = fy[k] * (1.f + s[k]);
      sum_g += g;
      sum_gx += g * ((fx[k] - m) * r);
    }
  }
  const float mean_g = warp_sum(sum_g) / dim, mean_gx = warp_sum(sum_gx) / dim;
  for (int c = lane; c < vectors; c += kWarp) {
    float fx[8], fy[8], s[8], fd[8];
    unpack8(xr[c], fx);
    unpack8(dyr[c], fy);
    unpack8(sc[c], s);
    unpack8(dxr[c], fd);
#pragma unroll
    for (int k = 0; k < 8; ++k) fd[k] += r * (fy[k] * (1.f + s[k]) - mean_g - (fx[k] - m) * r * mean_gx);
    dxr[c] = pack8(fd);
  }
}

// Block (blockIdx.x % column_blocks, blockIdx.x / column_blocks) = (vector pair, sample);
// thread (threadIdx.x, threadIdx.y) = (vector of the pair, token lane).
__global__ void __launch_bounds__(kSumVectors * kSumLanes)
    backward_sums_kernel(bf16* __restrict__ dshift, bf16* __restrict__ dscale, const bf16* __restrict__ dy,
                         const bf16* __restrict__ x, const float* __restrict__ mean,
                         const float* __restrict__ rstd, int64_t tokens, int dim, int column_blocks) {
  __shared__ float warp_sums[kSumWarps][kSumVectors][16];
  const int vectors = dim / 8;
  const int64_t b = blockIdx.x / column_blocks;
  const int c = blockIdx.x % column_blocks * kSumVectors + threadIdx.x;
  const uint4* dyv = reinterpret_cast<const uint4*>(dy);
  const uint4* xv = reinterpret_cast<const uint4*>(x);

  float sum_dy[8] = {}, sum_dyx[8] = {};
  if (c < vectors) {
    for (int64_t t = threadIdx.y; t < tokens; t += kSumLanes) {
      const int64_t row = b * tokens + t;
      float fy[8], fx[8];
      unpack8(dyv[row * vectors + c], fy);
      unpack8(xv[row * vectors + c], fx);
      const float m = mean[row], r = rstd[row];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        sum_dy[k] += fy[k];
        sum_dyx[k] += fy[k] * ((fx[k] - m) * r);
      }
    }
  }
  // A warp holds token lanes 16w .. 16w + 15 of both vectors (lane = 2 (ty % 16) + tx):
  // the offsets 2 .. 16 cross the token lanes and never the vectors.
#pragma unroll
  for (int o = kSumVectors; o < kWarp; o <<= 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      sum_dy[k] += __shfl_xor_sync(0xffffffffu, sum_dy[k], o);
      sum_dyx[k] += __shfl_xor_sync(0xffffffffu, sum_dyx[k], o);
    }
  }
  const int thread = threadIdx.y * kSumVectors + threadIdx.x;
  if (thread % kWarp < kSumVectors) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      warp_sums[thread / kWarp][threadIdx.x][k] = sum_dy[k];
      warp_sums[thread / kWarp][threadIdx.x][8 + k] = sum_dyx[k];
    }
  }
  __syncthreads();
  if (threadIdx.y != 0 || c >= vectors) return;
  float total_dy[8] = {}, total_dyx[8] = {};
  for (int w = 0; w < kSumWarps; ++w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      total_dy[k] += warp_sums[w][threadIdx.x][k];
      total_dyx[k] += warp_sums[w][threadIdx.x][8 + k];
    }
  }
  reinterpret_cast<uint4*>(dshift)[b * vectors + c] = pack8(total_dy);
  reinterpret_cast<uint4*>(dscale)[b * vectors + c] = pack8(total_dyx);
}

using NamedPointer = std::pair<const void*, const char*>;

// dim a multiple of 8 (whole 16-byte vectors per row) and every tensor 16-byte aligned.
void check_layout(const char* op, int64_t dim, std::initializer_list<NamedPointer> tensors) {
  FORGE_CHECK(dim % 8 == 0 && dim <= std::numeric_limits<int>::max(), "{}: dim {} must be a multiple of 8 on CUDA", op,
              dim);
  for (const auto& [pointer, what] : tensors)
    FORGE_CHECK(reinterpret_cast<uintptr_t>(pointer) % 16 == 0, "{}: {} must be 16-byte aligned on CUDA", op, what);
}

unsigned row_blocks(int64_t rows) {
  constexpr int per_block = kRowThreads / kWarp;
  return static_cast<unsigned>((rows + per_block - 1) / per_block);
}

}  // namespace

void modulated_layer_norm_forward(bf16* y, float* mean, float* rstd, const bf16* x, const bf16* shift,
                                  const bf16* scale, int64_t batch, int64_t tokens, int64_t dim, float eps) {
  check_layout("modulated_layer_norm_forward", dim, {{y, "y"}, {x, "x"}, {shift, "shift"}, {scale, "scale"}});
  const int64_t rows = batch * tokens;
  if (rows == 0) return;
  forward_kernel<<<row_blocks(rows), kRowThreads>>>(y, mean, rstd, x, shift, scale, rows, tokens,
                                                    static_cast<int>(dim), eps);
  FORGE_CUDA_LAUNCH_CHECK();
}

void modulated_layer_norm_backward(bf16* dx, bf16* dshift, bf16* dscale, const bf16* dy, const bf16* x,
                                   const bf16* scale, const float* mean, const float* rstd, int64_t batch,
                                   int64_t tokens, int64_t dim) {
  check_layout("modulated_layer_norm_backward", dim,
               {{dx, "dx"}, {dshift, "dshift"}, {dscale, "dscale"}, {dy, "dy"}, {x, "x"}, {scale, "scale"}});
  if (batch == 0 || dim == 0) return;
  const int64_t rows = batch * tokens;
  if (rows) {
    backward_dx_kernel<<<row_blocks(rows), kRowThreads>>>(dx, dy, x, scale, mean, rstd, rows, tokens,
                                                          static_cast<int>(dim));
    FORGE_CUDA_LAUNCH_CHECK();
  }
  const int column_blocks = static_cast<int>((dim / 8 + kSumVectors - 1) / kSumVectors);
  backward_sums_kernel<<<static_cast<unsigned>(batch * column_blocks), dim3(kSumVectors, kSumLanes)>>>(
      dshift, dscale, dy, x, mean, rstd, tokens, static_cast<int>(dim), column_blocks);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
