// MoE token movement on the GPU (kernels/cuda/moe.h): copying the tokens into expert order
// (moe_permute), adding the experts' weighted outputs back to their tokens (moe_combine),
// and their backwards; the CPU references are the fp32 loops of ops/moe.cpp (NOTE [MoE
// routing] in ops/moe.h). All four are memory-bound row copies and gathers of bf16 rows.
//
// A row is hidden / 8 vectors of 16 bytes (8 bf16); every load and store is one vector,
// converted to fp32 in registers (bf16x8.cuh). One block per output row (permute: a
// permuted row; the others: a token), its threads walking the row's vectors, so a block
// needs no division to find its row and every access of a warp is coalesced. The gathers
// (permute_backward, combine, combine_backward) load up to 8 of a token's k rows before
// adding them, so 8 loads are in flight per thread, and add them in j order in fp32, with
// one rounding to bf16 at the end: each output element has one writer and a fixed order,
// so the result is the same bits every run. permute_backward adds exactly as the CPU loop
// does (0 + row_0 + row_1 ..., in fp32), so its output is the CPU's rounded to bf16; combine
// multiplies and adds with fmaf (the CPU adds in double). combine_backward writes each
// row's weight times the token's gradient (one fp32 product, rounded once, as the CPU's) and
// each weight's gradient, a dot product over the row: each thread sums its vectors in order,
// then the warps' butterflies and a fixed-order fold of the warps in shared memory, 8 of a
// token's weights at a time; no atomics.
// Bytes for 32k tokens, k 8, hidden 7168 (bf16): permute writes 3.76 GB and reads x's 470
// MB; permute_backward the reverse; combine reads 3.76 + 0.47 GB and writes 470 MB;
// combine_backward reads 3.76 + 0.47 GB and writes 3.76 GB. Measured on an H100 (10 calls'
// mean): permute_backward 1.40 ms, combine 1.56, combine_backward 2.78, each about 3 TB/s on
// those bytes; permute 2.57 ms: its rows come in expert order, so each token's row is read
// k times, far apart, from DRAM rather than L2 (3.76 GB of reads, not 470 MB). A permute
// that scatters each token's row to its k rows (it would take row_of instead of source)
// would read x once: about 1.4 ms.
//
// Token dropping (NOTE [MoE capacity] in ops/moe.h) marks a dropped assignment with row_of
// -1 and a padding row with source -1: permute writes a padding row as zeros, the gathers
// skip dropped assignments (combine_backward writes their weight gradient as 0), and
// moe_zero_padding writes zeros over the padding rows of the experts' output gradient, which
// the experts' GEMMs read; a block per row, the blocks of other rows return at once.
//
// Assumes hidden % 8 == 0 and 16-byte aligned rows (checked), and row_of / source the
// inverse permutations from moe_sort_by_expert or moe_drop_to_capacity.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxThreads = 128;  // threads per block (one row): 2 to 8 vectors each at hidden 2048 to 8192
constexpr int kBatch = 8;         // rows of a token loaded before they are added

// permuted row r = x's row source[r] / k; zeros for padding (source[r] < 0).
__global__ void __launch_bounds__(kMaxThreads)
    permute_kernel(uint4* __restrict__ permuted, const uint4* __restrict__ x, const int32_t* __restrict__ source,
                   int k, int64_t vectors) {
  const int64_t r = blockIdx.x;
  uint4* to = permuted + r * vectors;
  if (source[r] < 0) {
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) to[c] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int64_t token = source[r] / k;
  const uint4* from = x + token * vectors;
#pragma unroll 4
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) to[c] = from[c];
}

// rows row r = zeros where source[r] < 0 (padding); other rows untouched.
__global__ void __launch_bounds__(kMaxThreads)
    zero_padding_kernel(uint4* __restrict__ rows, const int32_t* __restrict__ source, int64_t vectors) {
  const int64_t r = blockIdx.x;
  if (source[r] >= 0) return;
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) rows[r * vectors + c] = make_uint4(0, 0, 0, 0);
}

// dx row t = sum over j of d_permuted's row row_of[t * k + j], in fp32, in j order.
__global__ void __launch_bounds__(kMaxThreads)
    permute_backward_kernel(uint4* __restrict__ dx, const uint4* __restrict__ d_permuted,
                            const int32_t* __restrict__ row_of, int k, int64_t vectors) {
  const int64_t t = blockIdx.x;
  const int32_t* rows = row_of + t * k;
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j0 = 0; j0 < k; j0 += kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q)
        if (j0 + q < k && rows[j0 + q] >= 0) v[q] = d_permuted[static_cast<int64_t>(rows[j0 + q]) * vectors + c];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        if (j0 + q >= k) break;
        if (rows[j0 + q] < 0) continue;  // dropped
        float y[8];
        unpack8(v[q], y);
#pragma unroll
        for (int h = 0; h < 8; ++h) acc[h] = acc[h] + y[h];
      }
    }
    dx[t * vectors + c] = pack8(acc);
  }
}

// out row t = residual row t (may be out's own) + sum over j of weight x expert_out's row.
__global__ void __launch_bounds__(kMaxThreads)
    combine_kernel(uint4* out, const uint4* __restrict__ expert_out, const int32_t* __restrict__ row_of,
                   const float* __restrict__ weights, const uint4* residual, int k, int64_t vectors) {
  const int64_t t = blockIdx.x;
  const int32_t* rows = row_of + t * k;
  const float* w = weights + t * k;
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (residual) unpack8(residual[t * vectors + c], acc);  // read before out, the same element, is written
    for (int j0 = 0; j0 < k; j0 += kBatch) {
      uint4 v[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q)
        if (j0 + q < k && rows[j0 + q] >= 0) v[q] = expert_out[static_cast<int64_t>(rows[j0 + q]) * vectors + c];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        if (j0 + q >= k) break;
        if (rows[j0 + q] < 0) continue;  // dropped
        const float wq = w[j0 + q];
        float y[8];
        unpack8(v[q], y);
#pragma unroll
        for (int h = 0; h < 8; ++h) acc[h] = fmaf(wq, y[h], acc[h]);
      }
    }
    out[t * vectors + c] = pack8(acc);
  }
}

// d_expert_out row row_of[t * k + j] = weight x dout row t; d_weights[t * k + j] = dout row t
// . expert_out row row_of[t * k + j].
__global__ void __launch_bounds__(kMaxThreads)
    combine_backward_kernel(uint4* __restrict__ d_expert_out, float* __restrict__ d_weights,
                            const uint4* __restrict__ dout, const uint4* __restrict__ expert_out,
                            const int32_t* __restrict__ row_of, const float* __restrict__ weights, int k,
                            int64_t vectors) {
  __shared__ float warp_dots[kMaxThreads / kWarp][kBatch];
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, warps = blockDim.x / kWarp;
  for (int j0 = 0; j0 < k; j0 += kBatch) {
    const int batch = min(kBatch, k - j0);
    int64_t rows[kBatch];
    float w[kBatch], dot[kBatch];
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      rows[q] = q < batch ? row_of[t * k + j0 + q] : 0;
      w[q] = q < batch ? weights[t * k + j0 + q] : 0.f;
      dot[q] = 0.f;
    }
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      float g[8];
      unpack8(dout[t * vectors + c], g);
      uint4 v[kBatch];
#pragma unroll
      for (int q = 0; q < kBatch; ++q)
        if (q < batch && rows[q] >= 0) v[q] = expert_out[rows[q] * vectors + c];
#pragma unroll
      for (int q = 0; q < kBatch; ++q) {
        if (q >= batch) break;
        if (rows[q] < 0) continue;  // dropped: no row, its dot stays 0
        float y[8], dy[8];
        unpack8(v[q], y);
        float d = 0.f;
#pragma unroll
        for (int h = 0; h < 8; ++h) {
          d = fmaf(g[h], y[h], d);
          dy[h] = w[q] * g[h];
        }
        dot[q] += d;
        d_expert_out[rows[q] * vectors + c] = pack8(dy);
      }
    }
#pragma unroll
    for (int q = 0; q < kBatch; ++q) {
      float s = dot[q];
      for (int o = kWarp / 2; o > 0; o >>= 1) s += __shfl_xor_sync(kFullMask, s, o);
      if (lane == 0) warp_dots[warp][q] = s;
    }
    __syncthreads();
    if (static_cast<int>(threadIdx.x) < batch) {
      float s = 0.f;
      for (int i = 0; i < warps; ++i) s += warp_dots[i][threadIdx.x];
      d_weights[t * k + j0 + threadIdx.x] = s;
    }
    __syncthreads();  // warp_dots is read before the next batch writes it
  }
}

// Threads per row block: the row's vectors rounded up to a warp, at most kMaxThreads.
int threads_for(int64_t vectors) {
  const int64_t rounded = (vectors + kWarp - 1) / kWarp * kWarp;
  return static_cast<int>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(kWarp, rounded)));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void check_tokens(const char* op, int64_t tokens, int64_t k, int64_t hidden,
                  std::initializer_list<const void*> rows) {
  FORGE_CHECK(tokens >= 0 && k >= 1 && tokens * k <= INT32_MAX,
              "{}: {} tokens x top-k {} (k at least 1, the assignments within int32 indices)", op, tokens, k);
  FORGE_CHECK(hidden >= 8 && hidden % 8 == 0, "{}: hidden {} must be a positive multiple of 8 on CUDA", op, hidden);
  for (const void* p : rows)
    FORGE_CHECK(aligned16(p), "{}: a row buffer at {} is not 16-byte aligned (vectorized loads)", op, p);
}

}  // namespace

void moe_permute(bf16* permuted, const bf16* x, const int32_t* source, int64_t rows, int64_t k, int64_t hidden) {
  check_tokens("moe_permute", rows, 1, hidden, {permuted, x});
  FORGE_CHECK(k >= 1, "moe_permute: top-k {} must be at least 1", k);
  if (rows == 0) return;
  const int64_t vectors = hidden / 8;
  permute_kernel<<<static_cast<unsigned>(rows), threads_for(vectors)>>>(
      reinterpret_cast<uint4*>(permuted), reinterpret_cast<const uint4*>(x), source, static_cast<int>(k), vectors);
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_zero_padding(bf16* rows, const int32_t* source, int64_t n, int64_t hidden) {
  check_tokens("moe_zero_padding", n, 1, hidden, {rows});
  if (n == 0) return;
  const int64_t vectors = hidden / 8;
  zero_padding_kernel<<<static_cast<unsigned>(n), threads_for(vectors)>>>(reinterpret_cast<uint4*>(rows), source,
                                                                           vectors);
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_permute_backward(bf16* dx, const bf16* d_permuted, const int32_t* row_of, int64_t tokens, int64_t k,
                          int64_t hidden) {
  check_tokens("moe_permute_backward", tokens, k, hidden, {dx, d_permuted});
  if (tokens == 0) return;
  const int64_t vectors = hidden / 8;
  permute_backward_kernel<<<static_cast<unsigned>(tokens), threads_for(vectors)>>>(
      reinterpret_cast<uint4*>(dx), reinterpret_cast<const uint4*>(d_permuted), row_of, static_cast<int>(k), vectors);
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_combine(bf16* out, const bf16* expert_out, const int32_t* row_of, const float* weights, const bf16* residual,
                 int64_t tokens, int64_t k, int64_t hidden) {
  check_tokens("moe_combine", tokens, k, hidden, {out, expert_out, residual});
  if (tokens == 0) return;
  const int64_t vectors = hidden / 8;
  combine_kernel<<<static_cast<unsigned>(tokens), threads_for(vectors)>>>(
      reinterpret_cast<uint4*>(out), reinterpret_cast<const uint4*>(expert_out), row_of, weights,
      reinterpret_cast<const uint4*>(residual), static_cast<int>(k), vectors);
  FORGE_CUDA_LAUNCH_CHECK();
}

void moe_combine_backward(bf16* d_expert_out, float* d_weights, const bf16* dout, const bf16* expert_out,
                          const int32_t* row_of, const float* weights, int64_t tokens, int64_t k, int64_t hidden) {
  check_tokens("moe_combine_backward", tokens, k, hidden, {d_expert_out, dout, expert_out});
  if (tokens == 0) return;
  const int64_t vectors = hidden / 8;
  combine_backward_kernel<<<static_cast<unsigned>(tokens), threads_for(vectors)>>>(
      reinterpret_cast<uint4*>(d_expert_out), d_weights, reinterpret_cast<const uint4*>(dout),
      reinterpret_cast<const uint4*>(expert_out), row_of, weights, static_cast<int>(k), vectors);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
