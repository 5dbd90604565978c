// Attention of a few new query positions over a bf16 KV cache: the decode step of
// generation, where a token's query meets every key cached so far.
//
// What it computes: for query i of the step (absolute position p = position + i) and query
// head h (reading key/value head g = h / (Hq / Hkv)), out = softmax(scale q.K^T) V over
// the cached keys j in [first(p), p], first(p) = max(0, p - W + 1) with a sliding window
// W, else 0 — what the training attention lets position p see. Queries and keys have
// head_dim D elements, values and outputs v_head_dim Dv (NOTE [Value head dim] in
// ops/attention.h: DeepSeek's latent attention decodes with D = 192, Dv = 128); with Dv = D
// the 3-D layout of qkv is the 4-D one, so one kernel serves both forms.
//
// How: one thread block of four warps per (batch, query, head) row. Decoding has one query
// row per head and thousands of keys, so the keys are the parallel axis: warp w takes keys
// first + w, first + w + 4, ..., its 32 lanes splitting the head dimensions (lane l holds
// elements l, l + 32, ... of q and of the key, and of the value and its running output, so
// key and value rows are read coalesced). Each warp keeps an online softmax (running
// maximum m, running sum l, output rescaled by exp(m_old - m_new) whenever the maximum
// grows), then the four partial results are combined through shared memory with the same
// rescaling. Scores, sums and outputs are fp32; only the cache and q/out are bf16. q is
// pre-multiplied by the scale.
//
// What it assumes: D <= 256 and Dv <= 256 (8 elements per lane); the cache holds every
// position up to p (kv_cache_append wrote this step's keys and values first). It does not
// tile keys through shared memory nor share a key/value head's reads among its query heads:
// each query head reads the cache once, which for a decode step (one query per head) is the
// minimum for MHA and Hq/Hkv times it for GQA. Good enough for a sanity-check generator; a
// split-K (flash-decoding) variant would fill more SMs for a single long sequence.
#include "kernels/cuda/decode_attention.h"

#include <cmath>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kPerLane = kMaxHeadDim / 32;

__device__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

__host__ __device__ int64_t value_dim(const DecodeAttentionProblem& p) {
  return p.v_head_dim > 0 ? p.v_head_dim : p.head_dim;
}

// One thread per element of the step's keys and values. A token's kv_heads key heads
// (head_dim each) and then its kv_heads value heads (Dv each) follow its query heads in qkv,
// so element c of that run is element q_heads * head_dim + c of the token's row; its first
// kv_heads * head_dim elements are the position's row of the key cache, the rest its row of
// the value cache.
__global__ void kv_cache_append_kernel(bf16* k_cache, bf16* v_cache, const bf16* qkv, DecodeAttentionProblem p,
                                       int64_t total) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;  // of batch*queries*run
  if (e >= total) return;
  const int64_t dv = value_dim(p), keys = p.kv_heads * p.head_dim, values = p.kv_heads * dv;
  const int64_t c = e % (keys + values), bi = e / (keys + values);  // bi = b * queries + i
  const int64_t i = bi % p.queries, b = bi / p.queries;
  const int64_t width = (p.q_heads + p.kv_heads) * p.head_dim + values;
  const bf16 x = qkv[bi * width + p.q_heads * p.head_dim + c];
  const int64_t slot = b * p.capacity + p.position + i;  // the position's row of either cache
  if (c < keys)
    k_cache[slot * keys + c] = x;
  else
    v_cache[slot * values + (c - keys)] = x;
}

__global__ void __launch_bounds__(kWarps * 32)
    decode_attention_kernel(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                            DecodeAttentionProblem p) {
  const int64_t row = blockIdx.x;  // (b * queries + i) * q_heads + h
  const int64_t h = row % p.q_heads, bi = row / p.q_heads, i = bi % p.queries, b = bi / p.queries;
  const int64_t g = h / (p.q_heads / p.kv_heads);
  const int64_t last = p.position + i;
  const int64_t first = p.sliding_window > 0 ? max(int64_t{0}, last - p.sliding_window + 1) : 0;
  const int d = static_cast<int>(p.head_dim), dv = static_cast<int>(value_dim(p));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  const int64_t width = (p.q_heads + p.kv_heads) * p.head_dim + p.kv_heads * dv;
  const bf16* q = qkv + bi * width + h * p.head_dim;
  float qr[kPerLane], acc[kPerLane];
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int e = lane + 32 * r;
    qr[r] = e < d ? __bfloat162float(q[e]) * p.scale : 0.0f;
    acc[r] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t j = first + warp; j <= last; j += kWarps) {
    const int64_t slot = (b * p.capacity + j) * p.kv_heads + g;
    const bf16* k = k_cache + slot * p.head_dim;
    const bf16* v = v_cache + slot * dv;
    float s = 0.0f;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int e = lane + 32 * r;
      if (e < d) s += qr[r] * __bfloat162float(k[e]);
    }
    s = warp_sum(s);
    const float m_new = fmaxf(m, s);
    const float rescale = __expf(m - m_new), weight = __expf(s - m_new);
    l = l * rescale + weight;
#pragma unroll
    for (int r = 0; r < kPerLane; ++r) {
      const int e = lane + 32 * r;
      if (e < dv) acc[r] = acc[r] * rescale + weight * __bfloat162float(v[e]);
    }
    m = m_new;
  }

  __shared__ float warp_max[kWarps], warp_sum_exp[kWarps];
  __shared__ float warp_out[kWarps][kMaxHeadDim];
  if (lane == 0) {
    warp_max[warp] = m;
    warp_sum_exp[warp] = l;
  }
#pragma unroll
  for (int r = 0; r < kPerLane; ++r) {
    const int e = lane + 32 * r;
    if (e < dv) warp_out[warp][e] = acc[r];
  }
  __syncthreads();
  float m_all = -INFINITY;
  for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, warp_max[w]);
  float denominator = 0.0f;
  for (int w = 0; w < kWarps; ++w)
    if (warp_max[w] > -INFINITY) denominator += __expf(warp_max[w] - m_all) * warp_sum_exp[w];
  bf16* o = out + row * dv;
  for (int e = threadIdx.x; e < dv; e += blockDim.x) {
    float numerator = 0.0f;
    for (int w = 0; w < kWarps; ++w)
      if (warp_max[w] > -INFINITY) numerator += __expf(warp_max[w] - m_all) * warp_out[w][e];
    o[e] = __float2bfloat16(numerator / denominator);
  }
}

}  // namespace

void kv_cache_append(bf16* k_cache, bf16* v_cache, const bf16* qkv, const DecodeAttentionProblem& p) {
  const int64_t total = p.batch * p.queries * p.kv_heads * (p.head_dim + value_dim(p));
  if (total)
    kv_cache_append_kernel<<<static_cast<unsigned>((total + 255) / 256), 256>>>(k_cache, v_cache, qkv, p, total);
  FORGE_CUDA_LAUNCH_CHECK();
}

void decode_attention_forward(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                              const DecodeAttentionProblem& p) {
  FORGE_CHECK(p.head_dim <= kMaxHeadDim && value_dim(p) <= kMaxHeadDim,
              "decode attention: head_dim {} and v_head_dim {} must each be at most {} on CUDA", p.head_dim,
              value_dim(p), kMaxHeadDim);
  const int64_t rows = p.batch * p.queries * p.q_heads;
  FORGE_CHECK(rows < (int64_t{1} << 31), "decode attention: {} rows exceed a grid", rows);
  if (rows) decode_attention_kernel<<<static_cast<unsigned>(rows), kWarps * 32>>>(out, qkv, k_cache, v_cache, p);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
