// The softmax of dense attention's scores plus a bias, and the copies around it
// (see dense_attention_softmax.h and NOTE [Dense attention on the GPU] in
// dense_attention.cpp).
//
// Softmax: one row per block. The threads walk the row once, each keeping a
// running maximum m of the values x = score + bias it saw and the sum l of
// exp(x - m), rescaled by exp(m_old - m_new) whenever m grows (the online
// softmax: one read of the row for both statistics). The threads' (m, l) pairs
// meet in a shuffle butterfly within each warp, where both partners compute the
// same combination (float addition commutes), then across warps in warp order
// through shared memory, so every thread ends with the same bits and a row's
// result never depends on timing. A second walk writes exp(x - m) / l as bf16,
// and zeros in the row's padding (stride - kv_len columns). The bias (bf16) is
// widened to fp32 and everything is fp32 until the probability is rounded for
// the second GEMM. A row whose values are all -inf gives NaN (l = 0), as
// PyTorch's softmax does. 32 threads for rows of up to 64 keys, 128 up to 2048,
// else 256: a block's threads cover a T5 row (512) four times and a VAE row
// (4096 to 16384) 16 to 64 times.
//
// Copies: one thread per element with a grid-stride loop, bf16 element by
// element (head dims need not be multiples of 8 on the token-major side).
// Consecutive threads take consecutive columns on both sides, so a head's row
// is read and written coalesced.
#include <algorithm>
#include <climits>
#include <cmath>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/dense_attention_softmax.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kCopyThreads = 256;
constexpr int64_t kMaxCopyBlocks = int64_t{1} << 20;

__global__ void gather_heads_kernel(bf16* __restrict__ dst, const bf16* __restrict__ src, int64_t pair0, int64_t heads,
                                    int64_t seq, int64_t row0, int64_t valid_rows, int64_t dst_rows, int64_t cols,
                                    int64_t dst_cols, int64_t total) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t c = e % dst_cols, row = e / dst_cols % dst_rows, p = e / dst_cols / dst_rows;
    bf16 value = __float2bfloat16(0.f);
    if (row < valid_rows && c < cols) {
      const int64_t pair = pair0 + p, b = pair / heads, h = pair % heads;
      value = src[((b * seq + row0 + row) * heads + h) * cols + c];
    }
    dst[e] = value;
  }
}

__global__ void scatter_heads_kernel(bf16* __restrict__ out, const bf16* __restrict__ src, int64_t pair0, int64_t heads,
                                     int64_t seq, int64_t row0, int64_t rows, int64_t cols, int64_t src_cols,
                                     int64_t total) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += step) {
    const int64_t c = e % cols, row = e / cols % rows, p = e / cols / rows;
    const int64_t pair = pair0 + p, b = pair / heads, h = pair % heads;
    out[((b * seq + row0 + row) * heads + h) * cols + c] = src[(p * rows + row) * src_cols + c];
  }
}

// (m, l) := the running maximum and rescaled sum of two parts of a row, (m2,
// l2) the other.
__device__ __forceinline__ void combine(float& m, float& l, float m2, float l2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;  // both parts empty (or all -inf) so far
  l = l * expf(m - mx) + l2 * expf(m2 - mx);
  m = mx;
}

__global__ void softmax_bias_kernel(bf16* __restrict__ probs, const float* __restrict__ scores,
                                    const bf16* __restrict__ bias, int64_t rows, int64_t pair0, int64_t heads,
                                    int64_t q_len, int64_t row0, int64_t kv_len, int64_t stride) {
  __shared__ float warp_max[kWarp], warp_sum[kWarp];
  const int64_t r = blockIdx.x;
  const float* s = scores + r * stride;
  bf16* p = probs + r * stride;
  const bf16* b = bias ? bias + (((pair0 + r / rows) % heads) * q_len + row0 + r % rows) * kv_len : nullptr;

  float m = -INFINITY, l = 0.f;
  for (int64_t j = threadIdx.x; j < kv_len; j += blockDim.x)
    combine(m, l, s[j] + (b ? __bfloat162float(b[j]) : 0.f), 1.f);
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o), l2 = __shfl_xor_sync(0xffffffffu, l, o);
    combine(m, l, m2, l2);
  }
  if (threadIdx.x % kWarp == 0) {
    warp_max[threadIdx.x / kWarp] = m;
    warp_sum[threadIdx.x / kWarp] = l;
  }
  __syncthreads();
  m = warp_max[0];
  l = warp_sum[0];
  for (int w = 1; w < static_cast<int>(blockDim.x) / kWarp; ++w) combine(m, l, warp_max[w], warp_sum[w]);

  const float inv = 1.f / l;
  for (int64_t j = threadIdx.x; j < stride; j += blockDim.x) {
    const float value = j < kv_len ? expf(s[j] + (b ? __bfloat162float(b[j]) : 0.f) - m) * inv : 0.f;
    p[j] = __float2bfloat16(value);
  }
}

unsigned copy_blocks(int64_t total) {
  return static_cast<unsigned>(std::clamp<int64_t>((total + kCopyThreads - 1) / kCopyThreads, 1, kMaxCopyBlocks));
}

}  // namespace

void gather_heads(bf16* dst, const bf16* src, int64_t pair0, int64_t pairs, int64_t heads, int64_t seq, int64_t row0,
                  int64_t valid_rows, int64_t dst_rows, int64_t cols, int64_t dst_cols) {
  const int64_t total = pairs * dst_rows * dst_cols;
  if (total == 0) return;
  gather_heads_kernel<<<copy_blocks(total), kCopyThreads>>>(dst, src, pair0, heads, seq, row0, valid_rows, dst_rows,
                                                            cols, dst_cols, total);
  FORGE_CUDA_LAUNCH_CHECK();
}

void scatter_heads(bf16* out, const bf16* src, int64_t pair0, int64_t pairs, int64_t heads, int64_t seq, int64_t row0,
                   int64_t rows, int64_t cols, int64_t src_cols) {
  const int64_t total = pairs * rows * cols;
  if (total == 0) return;
  scatter_heads_kernel<<<copy_blocks(total), kCopyThreads>>>(out, src, pair0, heads, seq, row0, rows, cols, src_cols,
                                                             total);
  FORGE_CUDA_LAUNCH_CHECK();
}

void softmax_bias_rows(bf16* probs, const float* scores, const bf16* bias, int64_t pairs, int64_t rows, int64_t pair0,
                       int64_t heads, int64_t q_len, int64_t row0, int64_t kv_len, int64_t stride) {
  const int64_t blocks = pairs * rows;
  if (blocks == 0) return;
  FORGE_CHECK(blocks <= INT32_MAX, "softmax_bias_rows: {} rows in one launch", blocks);
  const int threads = kv_len <= 64 ? 32 : kv_len <= 2048 ? 128 : 256;
  softmax_bias_kernel<<<static_cast<unsigned>(blocks), threads>>>(probs, scores, bias, rows, pair0, heads, q_len, row0,
                                                                  kv_len, stride);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
