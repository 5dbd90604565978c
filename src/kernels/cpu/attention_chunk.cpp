// Exact causal grouped-query attention of a chunk of queries against keys and values of
// their own (NOTE [Chunk attention] in ops/attention_chunk.h), forward and backward: the
// reference the cuDNN path is tested against, and the CPU's context parallelism.
//
// The arithmetic is the training attention's (kernels/cpu/attention.cpp): query i of the
// chunk sits at position t = position + i of its sequence and attends to keys j in
// [first(t), t], first(t) = max(0, t - W + 1) with a window W, else 0, and with packed
// examples no earlier than the first position of t's example (not causal: every key of
// kv, [0, kv_seq), or with a window the keys j > position + i - W of a kv lying wholly
// before the chunk, or with packed examples the keys from first_key on, out 0 and lse -inf
// for a query that sees none); one (batch, head, query)
// row at a time forward (attend_row), and in the backward, recomputing p_j = exp(s_j - lse_i),
//   dv_j += p_j dout_i      dS_j = p_j (dout_i.v_j - dout_i.out_i)
//   dq_i = scale sum_j dS_j k_j      dk_j += scale dS_j q_i
// Only the places differ: queries are read from the chunk's packed qkv, keys and values
// from kv, and dk/dv go to dkv, which spans every position of the sequences (the rows the
// chunk does not see stay zero). Threads own (batch, kv head) pairs in the backward, each
// writing only its kv head's dk/dv and its query heads' dq, in a fixed loop order (NOTE
// [Deterministic CPU parallelism]).
#include "kernels/cpu/attention_chunk.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/attention_row.h"
#include "kernels/cpu/vector_math.h"

namespace forge::cpu {
namespace {

// Element offsets into the chunk's tensors and kv.
struct Layout {
  const AttentionChunkDims& d;

  int64_t query(int64_t b, int64_t i, int64_t h) const {
    return ((b * d.queries + i) * (d.q_heads + 2 * d.kv_heads) + h) * d.head_dim;
  }
  int64_t key(int64_t b, int64_t j, int64_t g) const { return ((b * d.kv_seq + j) * 2 * d.kv_heads + g) * d.head_dim; }
  int64_t value(int64_t b, int64_t j, int64_t g) const { return key(b, j, d.kv_heads + g); }
  int64_t out_row(int64_t b, int64_t i, int64_t h) const { return ((b * d.queries + i) * d.q_heads + h) * d.head_dim; }
  int64_t lse_index(int64_t b, int64_t h, int64_t i) const { return (b * d.q_heads + h) * d.queries + i; }
  // The keys query i of the chunk in row b sees: [first_key(b, i), last_key(i)].
  int64_t last_key(int64_t i) const { return d.causal ? d.position + i : d.kv_seq - 1; }
  // Not causal with a window: kv lies wholly before the chunk, whose first query is `position`
  // positions after kv's first key (NOTE [Full chunk attention with a sliding window]); a
  // query may see no key at all (first > last).
  int64_t first_key(int64_t b, int64_t i) const {
    if (!d.causal) {
      const int64_t window = d.window > 0 ? std::max<int64_t>(0, d.position + i - d.window + 1) : 0;
      return d.first_key ? std::max<int64_t>(window, d.first_key[b * d.queries + i]) : window;
    }
    const int64_t example = d.example_start ? d.example_start[b * d.kv_seq + last_key(i)] : 0;
    return std::max<int64_t>(example, d.window > 0 ? last_key(i) - d.window + 1 : 0);
  }
  int64_t kv_head_of(int64_t h) const { return h / (d.q_heads / d.kv_heads); }
};

}  // namespace

void attention_chunk_forward(float* out, float* lse, const float* qkv, const float* kv,
                             const AttentionChunkDims& dims) {
  const Layout at{dims};
  const int64_t rows = dims.batch * dims.q_heads * dims.queries;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, dims.kv_seq * dims.head_dim));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(static_cast<size_t>(dims.kv_seq));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % dims.queries, h = (row / dims.queries) % dims.q_heads;
      const int64_t b = row / (dims.queries * dims.q_heads), g = at.kv_head_of(h);
      if (at.first_key(b, i) > at.last_key(i)) {  // no key: nothing to attend to, lse -inf
        std::fill_n(out + at.out_row(b, i, h), dims.head_dim, 0.0f);
        lse[at.lse_index(b, h, i)] = -INFINITY;
        continue;
      }
      const double row_lse = attend_row(
          out + at.out_row(b, i, h), qkv + at.query(b, i, h), at.first_key(b, i), at.last_key(i), dims.scale,
          dims.head_dim, dims.head_dim, p.data(), [&](int64_t j) { return kv + at.key(b, j, g); },
          [&](int64_t j) { return kv + at.value(b, j, g); });
      lse[at.lse_index(b, h, i)] = static_cast<float>(row_lse);
    }
  });
}

void attention_chunk_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, const AttentionChunkDims& dims) {
  const Layout at{dims};
  const int64_t group = dims.q_heads / dims.kv_heads, d = dims.head_dim;
  parallel_for(dims.batch * dims.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / dims.kv_heads, g = pair % dims.kv_heads;
      for (int64_t j = 0; j < dims.kv_seq; ++j) {
        std::fill_n(dkv + at.key(b, j, g), d, 0.0f);
        std::fill_n(dkv + at.value(b, j, g), d, 0.0f);
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = 0; i < dims.queries; ++i) {
          const float* q = qkv + at.query(b, i, h);
          const float* dout_i = dout + at.out_row(b, i, h);
          float* dq = dqkv + at.query(b, i, h);
          std::fill_n(dq, d, 0.0f);
          const float lse_i = lse[at.lse_index(b, h, i)];
          const float correction = dot(dout_i, out + at.out_row(b, i, h), d);
          for (int64_t j = at.first_key(b, i); j <= at.last_key(i); ++j) {
            const float* k = kv + at.key(b, j, g);
            const float* v = kv + at.value(b, j, g);
            const float p = std::exp(dims.scale * dot(q, k, d) - lse_i);
            const float dscore = dims.scale * p * (dot(dout_i, v, d) - correction);
            axpy(dkv + at.value(b, j, g), p, dout_i, d);
            axpy(dkv + at.key(b, j, g), dscore, q, d);
            axpy(dq, dscore, k, d);
          }
        }
      }
    }
  });
}

}  // namespace forge::cpu
