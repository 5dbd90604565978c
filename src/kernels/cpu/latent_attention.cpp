// Multi-head Latent Attention's packed Q/K/V rows on the CPU, the fp32 reference for the
// CUDA kernels (NOTE [MLA packed QKV] in ops/latent_attention.h).
//
// Per token, the forward copies the H query nope parts, key nope parts and value parts
// into the packed row and writes each head's query rope part and the shared key rope part
// rotated, rotate-half style as kernels/cpu/rope.cpp does:
//   x'[i]        = x[i] * cos(t f_i) - x[i + half] * sin(t f_i)
//   x'[i + half] = x[i + half] * cos(t f_i) + x[i] * sin(t f_i)
// k_pe is rotated once per token and copied to every key head. The backward is the
// transpose: the copies run the other way, the query rope gradients are rotated back (sin
// negated), and k_pe's gradient is the sum of its H copies' gradients (fp32, head order),
// rotated back once. Tokens are independent; threads split them, so each output element
// has one writer and a fixed order (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/latent_attention.h"

#include <algorithm>
#include <vector>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

// out = the rotation of the pair halves (lo, hi) by the angles of one table row; sin_sign
// -1 rotates back. out may not alias the inputs.
void rotate(float* out, const float* lo, const float* hi, const float* c, const float* s, int64_t half,
            float sin_sign) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = lo[i], b = hi[i], si = sin_sign * s[i];
    out[i] = a * c[i] - b * si;
    out[i + half] = b * c[i] + a * si;
  }
}

int64_t grain_for(int64_t row_width) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(row_width, 1)); }

}  // namespace

void mla_pack_qkv(float* qkv, const float* q, const float* kv_a, const float* kv, int64_t batch, int64_t seq,
                  int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank, const float* cos,
                  const float* sin, const int32_t* positions) {
  const int64_t qk = nope_dim + rope_dim, half = rope_dim / 2;
  const int64_t width = heads * (2 * qk + v_dim), kv_a_width = kv_rank + rope_dim, kv_width = heads * (nope_dim + v_dim);
  parallel_for(batch * seq, grain_for(width), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t t = positions ? positions[n] : n % seq;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      float* row = qkv + n * width;
      float* keys = row + heads * qk;
      float* values = keys + heads * qk;
      const float* q_row = q + n * heads * qk;
      const float* kv_row = kv + n * kv_width;
      const float* k_pe = kv_a + n * kv_a_width + kv_rank;
      for (int64_t h = 0; h < heads; ++h) {
        const float* qh = q_row + h * qk;
        std::copy(qh, qh + nope_dim, row + h * qk);
        rotate(row + h * qk + nope_dim, qh + nope_dim, qh + nope_dim + half, c, s, half, 1.0f);
      }
      rotate(keys + nope_dim, k_pe, k_pe + half, c, s, half, 1.0f);
      for (int64_t h = 0; h < heads; ++h) {
        const float* kvh = kv_row + h * (nope_dim + v_dim);
        float* kh = keys + h * qk;
        std::copy(kvh, kvh + nope_dim, kh);
        if (h > 0) std::copy(keys + nope_dim, keys + qk, kh + nope_dim);
        std::copy(kvh + nope_dim, kvh + nope_dim + v_dim, values + h * v_dim);
      }
    }
  });
}

void mla_pack_qkv_backward(float* d_q, float* d_kv_a, float* d_kv, const float* d_qkv, int64_t batch, int64_t seq,
                           int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank,
                           const float* cos, const float* sin, const int32_t* positions) {
  const int64_t qk = nope_dim + rope_dim, half = rope_dim / 2;
  const int64_t width = heads * (2 * qk + v_dim), kv_a_width = kv_rank + rope_dim, kv_width = heads * (nope_dim + v_dim);
  parallel_for(batch * seq, grain_for(width), [&](int64_t begin, int64_t end) {
    std::vector<float> k_pe_sum(static_cast<size_t>(rope_dim));
    for (int64_t n = begin; n < end; ++n) {
      const int64_t t = positions ? positions[n] : n % seq;
      const float* c = cos + t * half;
      const float* s = sin + t * half;
      const float* row = d_qkv + n * width;
      const float* keys = row + heads * qk;
      const float* values = keys + heads * qk;
      float* dq_row = d_q + n * heads * qk;
      float* dkv_row = d_kv + n * kv_width;
      for (int64_t h = 0; h < heads; ++h) {
        const float* g = row + h * qk;
        std::copy(g, g + nope_dim, dq_row + h * qk);
        rotate(dq_row + h * qk + nope_dim, g + nope_dim, g + nope_dim + half, c, s, half, -1.0f);
      }
      std::fill(k_pe_sum.begin(), k_pe_sum.end(), 0.0f);
      for (int64_t h = 0; h < heads; ++h) {
        const float* kh = keys + h * qk;
        float* dkvh = dkv_row + h * (nope_dim + v_dim);
        std::copy(kh, kh + nope_dim, dkvh);
        for (int64_t i = 0; i < rope_dim; ++i) k_pe_sum[i] += kh[nope_dim + i];
        std::copy(values + h * v_dim, values + (h + 1) * v_dim, dkvh + nope_dim);
      }
      rotate(d_kv_a + n * kv_a_width + kv_rank, k_pe_sum.data(), k_pe_sum.data() + half, c, s, half, -1.0f);
    }
  });
}

}  // namespace forge::cpu
