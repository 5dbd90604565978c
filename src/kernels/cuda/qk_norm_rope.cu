// QK RMSNorm and adjacent-pair rotary embeddings on the GPU, for one stream of a joint
// attention written into its rows of the joint qkv (ops/qk_norm_rope.h; the formulas are
// in kernels/cpu/qk_norm_rope.cpp).
//
// One warp per (token, head) row of D bf16 elements. A rotation pair (2i, 2i+1) is one
// 4-byte bf16x2 word, so lane l holds pairs l, l + 32, ... (P = 1, 2 or 4 of them, a
// template argument, so D <= 256 stays in registers): every load is a coalesced word, the
// row's sum of squares is a butterfly of shuffles, and each pair is normalized, scaled and
// rotated in fp32 and stored once. Value rows are copied word by word. rstd is written by
// lane 0. Bytes for FLUX's double block image stream ([1, 4096, 72, 128]): read and write
// 75 MB each, 0.05 ms at 3 TB/s.
//
// Backward, per row: g (the stream's row of dqkv) is rotated back, dy = R^T g, then
// dx = r w dy - x r^3 mean(w dy x) overwrites dqkv_in (value rows: g copied). The weight
// gradients dw += dy x r ride along in registers as in kernels/cuda/rmsnorm.cu: each block
// takes a fixed range of tokens (about 1056 blocks), its warps take the range's rows in turn
// and keep the sums of their pairs' columns, separately for query and key rows; the warps'
// sums are added in warp order through shared memory into one partial row of 2D floats
// per block (scratch), and sum_partial_rows (kernels/cuda/partial_sums.h) adds the blocks'
// rows in a fixed order into dq_weight and dk_weight. No float atomics, and a partition
// that depends on the shape only: the gradients are deterministic.
#include "kernels/cuda/qk_norm_rope.h"

#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/partial_sums.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 8;              // per block
constexpr int kMaxPairsPerLane = 4;    // head_dim up to 2 * 4 * 32 = 256
constexpr int kMaxDim = 2 * kMaxPairsPerLane * kWarp;
// About this many partial rows: 8 blocks of 8 warps per H100/H200 SM, enough warps in flight
// to hide the loads (264 left 16 warps per SM and ran the FLUX proxy's backward at a third
// of its bandwidth); the partial rows are 2 D floats each, 1 MB at D = 128.
constexpr int kBackwardBlocks = 1056;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Where the stream's token n (b * stream_seq + t), head `head`, sits in the joint qkv, and
// the row of its angles, in pairs.
__device__ __forceinline__ int64_t joint_row(const QkNormRopeProblem& p, int64_t n, int64_t head) {
  const int64_t b = n / p.stream_seq, t = n % p.stream_seq;
  return ((b * p.seq + p.offset + t) * 3 * p.heads + head) * p.head_dim;
}
__device__ __forceinline__ int64_t angle_row(const QkNormRopeProblem& p, int64_t n) {
  return (p.offset + n % p.stream_seq) * (p.head_dim / 2);
}

__device__ __forceinline__ const __nv_bfloat162* pairs(const bf16* p) {
  return reinterpret_cast<const __nv_bfloat162*>(p);
}
__device__ __forceinline__ __nv_bfloat162* pairs(bf16* p) { return reinterpret_cast<__nv_bfloat162*>(p); }

template <int P>
__global__ void __launch_bounds__(kWarps * kWarp)
    qk_norm_rope_forward_kernel(bf16* qkv, float* rstd, const bf16* qkv_in, const bf16* q_weight,
                                const bf16* k_weight, float eps, const float* cos, const float* sin,
                                QkNormRopeProblem p) {
  const int lane = threadIdx.x % kWarp, half = static_cast<int>(p.head_dim / 2);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarp;
  const int64_t row_heads = 3 * p.heads;
  if (row >= p.batch * p.stream_seq * row_heads) return;  // the whole warp: row is uniform over it
  const int64_t n = row / row_heads, head = row % row_heads;
  const __nv_bfloat162* x = pairs(qkv_in + row * p.head_dim);
  __nv_bfloat162* z = pairs(qkv + joint_row(p, n, head));
  if (head >= 2 * p.heads) {
    for (int i = lane; i < half; i += kWarp) z[i] = x[i];
    return;
  }
  float2 v[P];
  float sum_sq = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int i = lane + k * kWarp;
    v[k] = i < half ? __bfloat1622float2(x[i]) : make_float2(0.f, 0.f);
    sum_sq += v[k].x * v[k].x + v[k].y * v[k].y;
  }
  const float r = rsqrtf(warp_sum(sum_sq) / static_cast<float>(p.head_dim) + eps);
  if (lane == 0) rstd[n * 2 * p.heads + head] = r;
  const __nv_bfloat162* w = pairs(head < p.heads ? q_weight : k_weight);
  const float* c = cos + angle_row(p, n);
  const float* s = sin + angle_row(p, n);
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int i = lane + k * kWarp;
    if (i >= half) continue;
    const float2 wf = __bfloat1622float2(w[i]);
    const float y0 = v[k].x * r * wf.x, y1 = v[k].y * r * wf.y, ci = c[i], si = s[i];
    z[i] = __floats2bfloat162_rn(y0 * ci - y1 * si, y0 * si + y1 * ci);
  }
}

// Block b takes tokens [b * tokens_per_part, ...) of the stream; partial is [gridDim.x, 2D]:
// the query weight's columns, then the key weight's.
template <int P>
__global__ void __launch_bounds__(kWarps * kWarp)
    qk_norm_rope_backward_kernel(bf16* dqkv_in, float* partial, const bf16* dqkv, const bf16* qkv_in,
                                 const bf16* q_weight, const bf16* k_weight, const float* rstd, const float* cos,
                                 const float* sin, QkNormRopeProblem p, int64_t tokens_per_part) {
  __shared__ float warp_sums[kWarps][2 * kMaxDim];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, half = static_cast<int>(p.head_dim / 2);
  const int64_t row_heads = 3 * p.heads, tokens = p.batch * p.stream_seq;
  const int64_t first_token = static_cast<int64_t>(blockIdx.x) * tokens_per_part;
  const int64_t end_row = min(tokens, first_token + tokens_per_part) * row_heads;
  float2 acc_q[P], acc_k[P];
#pragma unroll
  for (int k = 0; k < P; ++k) acc_q[k] = acc_k[k] = make_float2(0.f, 0.f);

  for (int64_t row = first_token * row_heads + warp; row < end_row; row += kWarps) {
    const int64_t n = row / row_heads, head = row % row_heads;
    const __nv_bfloat162* g = pairs(dqkv + joint_row(p, n, head));
    __nv_bfloat162* dx = pairs(dqkv_in + row * p.head_dim);
    if (head >= 2 * p.heads) {
      for (int i = lane; i < half; i += kWarp) dx[i] = g[i];
      continue;
    }
    const __nv_bfloat162* x = pairs(qkv_in + row * p.head_dim);
    const __nv_bfloat162* w = pairs(head < p.heads ? q_weight : k_weight);
    const float* c = cos + angle_row(p, n);
    const float* s = sin + angle_row(p, n);
    float2 dy[P], xv[P], wv[P];
    float dot = 0.f;  // sum of w dy x over the row
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int i = lane + k * kWarp;
      dy[k] = xv[k] = wv[k] = make_float2(0.f, 0.f);
      if (i >= half) continue;
      const float2 gf = __bfloat1622float2(g[i]);
      const float ci = c[i], si = s[i];
      dy[k] = make_float2(gf.x * ci + gf.y * si, gf.y * ci - gf.x * si);
      xv[k] = __bfloat1622float2(x[i]);
      wv[k] = __bfloat1622float2(w[i]);
      dot += dy[k].x * wv[k].x * xv[k].x + dy[k].y * wv[k].y * xv[k].y;
    }
    const float r = rstd[n * 2 * p.heads + head];
    const float correction = warp_sum(dot) / static_cast<float>(p.head_dim) * r * r * r;
    const bool query = head < p.heads;
#pragma unroll
    for (int k = 0; k < P; ++k) {
      const int i = lane + k * kWarp;
      if (i >= half) continue;
      dx[i] = __floats2bfloat162_rn(r * dy[k].x * wv[k].x - xv[k].x * correction,
                                    r * dy[k].y * wv[k].y - xv[k].y * correction);
      const float2 dw = make_float2(dy[k].x * xv[k].x * r, dy[k].y * xv[k].y * r);
      if (query) {
        acc_q[k].x += dw.x, acc_q[k].y += dw.y;
      } else {
        acc_k[k].x += dw.x, acc_k[k].y += dw.y;
      }
    }
  }

  float* mine = warp_sums[warp];
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const int i = lane + k * kWarp;
    if (i >= half) continue;
    mine[2 * i] = acc_q[k].x, mine[2 * i + 1] = acc_q[k].y;
    mine[p.head_dim + 2 * i] = acc_k[k].x, mine[p.head_dim + 2 * i + 1] = acc_k[k].y;
  }
  __syncthreads();
  float* part = partial + static_cast<int64_t>(blockIdx.x) * 2 * p.head_dim;
  for (int col = threadIdx.x; col < 2 * p.head_dim; col += blockDim.x) {
    float sum = 0.f;
    for (int w = 0; w < kWarps; ++w) sum += warp_sums[w][col];
    part[col] = sum;
  }
}

// Pairs per lane: the smallest power of two that covers D / 2 pairs with 32 lanes.
int pairs_per_lane(int64_t head_dim) {
  int per_lane = 1;
  while (per_lane * kWarp < head_dim / 2) per_lane *= 2;
  return per_lane;
}

void check_problem(const QkNormRopeProblem& p, std::initializer_list<const void*> pointers) {
  FORGE_CHECK(p.head_dim % 2 == 0 && p.head_dim > 0 && p.head_dim <= kMaxDim,
              "qk_norm_rope: head_dim {} must be even and at most {} on CUDA", p.head_dim, kMaxDim);
  for (const void* pointer : pointers)
    FORGE_CHECK(reinterpret_cast<uintptr_t>(pointer) % sizeof(__nv_bfloat162) == 0,
                "qk_norm_rope: a bf16 tensor at {} is not 4-byte aligned", pointer);
}

}  // namespace

void qk_norm_rope_forward(bf16* qkv, float* rstd, const bf16* qkv_in, const bf16* q_weight, const bf16* k_weight,
                          float eps, const float* cos, const float* sin, const QkNormRopeProblem& p) {
  check_problem(p, {qkv, qkv_in, q_weight, k_weight});
  const int64_t rows = p.batch * p.stream_seq * 3 * p.heads;
  if (rows == 0) return;
  const unsigned grid = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  switch (pairs_per_lane(p.head_dim)) {
    case 1: qk_norm_rope_forward_kernel<1><<<grid, kWarps * kWarp>>>(qkv, rstd, qkv_in, q_weight, k_weight, eps, cos, sin, p); break;
    case 2: qk_norm_rope_forward_kernel<2><<<grid, kWarps * kWarp>>>(qkv, rstd, qkv_in, q_weight, k_weight, eps, cos, sin, p); break;
    default: qk_norm_rope_forward_kernel<4><<<grid, kWarps * kWarp>>>(qkv, rstd, qkv_in, q_weight, k_weight, eps, cos, sin, p);
  }
  FORGE_CUDA_LAUNCH_CHECK();
}

void qk_norm_rope_backward(bf16* dqkv_in, float* dq_weight, float* dk_weight, const bf16* dqkv, const bf16* qkv_in,
                           const bf16* q_weight, const bf16* k_weight, const float* rstd, const float* cos,
                           const float* sin, const QkNormRopeProblem& p) {
  check_problem(p, {dqkv_in, dqkv, qkv_in, q_weight, k_weight});
  const int64_t tokens = p.batch * p.stream_seq;
  if (tokens == 0 || p.heads == 0) return;
  // A split that depends on the token count only, never on the device.
  const int64_t tokens_per_part = (tokens + kBackwardBlocks - 1) / kBackwardBlocks;
  const int64_t parts = (tokens + tokens_per_part - 1) / tokens_per_part;
  float* partial = static_cast<float*>(
      scratch_buffer(ScratchSlot::QkNormRopePartials, sizeof(float) * static_cast<size_t>(parts * 2 * p.head_dim)));
  const unsigned grid = static_cast<unsigned>(parts);
  switch (pairs_per_lane(p.head_dim)) {
    case 1:
      qk_norm_rope_backward_kernel<1><<<grid, kWarps * kWarp>>>(dqkv_in, partial, dqkv, qkv_in, q_weight, k_weight,
                                                               rstd, cos, sin, p, tokens_per_part);
      break;
    case 2:
      qk_norm_rope_backward_kernel<2><<<grid, kWarps * kWarp>>>(dqkv_in, partial, dqkv, qkv_in, q_weight, k_weight,
                                                               rstd, cos, sin, p, tokens_per_part);
      break;
    default:
      qk_norm_rope_backward_kernel<4><<<grid, kWarps * kWarp>>>(dqkv_in, partial, dqkv, qkv_in, q_weight, k_weight,
                                                               rstd, cos, sin, p, tokens_per_part);
  }
  FORGE_CUDA_LAUNCH_CHECK();
  sum_partial_rows(dq_weight, partial, parts, p.head_dim, 2 * p.head_dim, /*accumulate=*/true);
  sum_partial_rows(dk_weight, partial + p.head_dim, parts, p.head_dim, 2 * p.head_dim, /*accumulate=*/true);
}

}  // namespace forge::cuda
