// The gated residual add of adaLN-Zero blocks on the GPU, bf16 with fp32 arithmetic.
//
// Forward, out[b,t,d] = x[b,t,d] + gate[b,d] y[b,t,d]: elementwise, one thread per 16-byte
// vector (8 columns) of x, y and out; the gate row is small and stays in L1/L2. out is the
// residual stream's next copy (the block's output beside its input, which the backward
// reads) or x itself; each thread reads its vector of x before writing the same vector of
// out, so the two may be one buffer (neither is __restrict__).
//
// Backward, one pass over dx and y that does both jobs:
//   dy[b,t,d] = gate[b,d] dx[b,t,d]          (overwritten)
//   dgate[b,d] = sum_t dx y                  (overwritten)
// A block owns 16 columns (2 vectors) of one sample; its 128 token lanes walk t = lane,
// lane + 128, ... (a 32-byte sector per row and vector pair), each writing dy for its rows
// and summing dx y in fp32 in registers, the gate vector loaded once. The lanes' sums meet
// in a shuffle butterfly within each warp, then the warps' sums are added in warp order
// from shared memory and rounded to bf16 once: no atomics, a partition fixed by the shapes,
// the same bits every run (the layout of kernels/cuda/modulated_layer_norm.cu's sums).
//
// Assumes dim is a multiple of 8 and 16-byte aligned tensors; checked.
#include "kernels/cuda/gated_residual.h"

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kSumVectors = 2;   // 16-byte vectors (16 columns) per block of the backward
constexpr int kSumLanes = 128;   // threads walking the tokens of each vector
constexpr int kSumWarps = kSumVectors * kSumLanes / kWarp;

__global__ void forward_kernel(bf16* out, const bf16* x, const bf16* __restrict__ y, const bf16* __restrict__ gate,
                               int64_t tokens, int vectors, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t row = i / vectors;
  float fx[8], fy[8], g[8];
  unpack8(reinterpret_cast<const uint4*>(x)[i], fx);
  unpack8(reinterpret_cast<const uint4*>(y)[i], fy);
  unpack8(reinterpret_cast<const uint4*>(gate)[row / tokens * vectors + i % vectors], g);
#pragma unroll
  for (int k = 0; k < 8; ++k) fx[k] += g[k] * fy[k];
  reinterpret_cast<uint4*>(out)[i] = pack8(fx);
}

// Block (blockIdx.x % column_blocks, blockIdx.x / column_blocks) = (vector pair, sample);
// thread (threadIdx.x, threadIdx.y) = (vector of the pair, token lane).
__global__ void __launch_bounds__(kSumVectors * kSumLanes)
    backward_kernel(bf16* __restrict__ dy, bf16* __restrict__ dgate, const bf16* __restrict__ dx,
                    const bf16* __restrict__ y, const bf16* __restrict__ gate, int64_t tokens, int vectors,
                    int column_blocks) {
  __shared__ float warp_sums[kSumWarps][kSumVectors][8];
  const int64_t b = blockIdx.x / column_blocks;
  const int c = blockIdx.x % column_blocks * kSumVectors + threadIdx.x;

  float sum[8] = {};
  if (c < vectors) {
    float g[8];
    unpack8(reinterpret_cast<const uint4*>(gate)[b * vectors + c], g);
    for (int64_t t = threadIdx.y; t < tokens; t += kSumLanes) {
      const int64_t at = (b * tokens + t) * vectors + c;
      float fd[8], fy[8];
      unpack8(reinterpret_cast<const uint4*>(dx)[at], fd);
      unpack8(reinterpret_cast<const uint4*>(y)[at], fy);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        sum[k] += fd[k] * fy[k];
        fy[k] = g[k] * fd[k];
      }
      reinterpret_cast<uint4*>(dy)[at] = pack8(fy);
    }
  }
  // A warp holds token lanes 16w .. 16w + 15 of both vectors (lane = 2 (ty % 16) + tx):
  // the offsets 2 .. 16 cross the token lanes and never the vectors.
#pragma unroll
  for (int o = kSumVectors; o < kWarp; o <<= 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k) sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], o);
  }
  const int thread = threadIdx.y * kSumVectors + threadIdx.x;
  if (thread % kWarp < kSumVectors) {
#pragma unroll
    for (int k = 0; k < 8; ++k) warp_sums[thread / kWarp][threadIdx.x][k] = sum[k];
  }
  __syncthreads();
  if (threadIdx.y != 0 || c >= vectors) return;
  float total[8] = {};
  for (int w = 0; w < kSumWarps; ++w) {
#pragma unroll
    for (int k = 0; k < 8; ++k) total[k] += warp_sums[w][threadIdx.x][k];
  }
  reinterpret_cast<uint4*>(dgate)[b * vectors + c] = pack8(total);
}

using NamedPointer = std::pair<const void*, const char*>;

// dim a multiple of 8 (whole 16-byte vectors per row) and every tensor 16-byte aligned.
void check_layout(const char* op, int64_t dim, std::initializer_list<NamedPointer> tensors) {
  FORGE_CHECK(dim % 8 == 0 && dim <= std::numeric_limits<int>::max(), "{}: dim {} must be a multiple of 8 on CUDA", op,
              dim);
  for (const auto& [pointer, what] : tensors)
    FORGE_CHECK(reinterpret_cast<uintptr_t>(pointer) % 16 == 0, "{}: {} must be 16-byte aligned on CUDA", op, what);
}

}  // namespace

void gated_residual_forward(bf16* out, const bf16* x, const bf16* y, const bf16* gate, int64_t batch, int64_t tokens,
                            int64_t dim) {
  check_layout("gated_residual_forward", dim, {{out, "out"}, {x, "x"}, {y, "y"}, {gate, "gate"}});
  const int64_t n = batch * tokens * (dim / 8);
  if (n == 0) return;
  forward_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads>>>(
      out, x, y, gate, tokens, static_cast<int>(dim / 8), n);
  FORGE_CUDA_LAUNCH_CHECK();
}

void gated_residual_backward(bf16* dy, bf16* dgate, const bf16* dx, const bf16* y, const bf16* gate, int64_t batch,
                             int64_t tokens, int64_t dim) {
  check_layout("gated_residual_backward", dim,
               {{dy, "dy"}, {dgate, "dgate"}, {dx, "dx"}, {y, "y"}, {gate, "gate"}});
  if (batch == 0 || dim == 0) return;
  const int vectors = static_cast<int>(dim / 8);
  const int column_blocks = (vectors + kSumVectors - 1) / kSumVectors;
  backward_kernel<<<static_cast<unsigned>(batch * column_blocks), dim3(kSumVectors, kSumLanes)>>>(
      dy, dgate, dx, y, gate, tokens, vectors, column_blocks);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
