// Exact grouped-query attention, causal or not, forward and backward, on the packed QKV tensor.
// Queries and keys have head_dim elements, values and outputs v_head_dim (NOTE [Value head
// dim] in ops/attention.h); every loop below runs over the dim of the vectors it touches,
// so equal dims are simply the case v_head_dim = head_dim.
//
// Query position i of query head h attends to key positions j in [first(i), last(i)], where
// first(i) = 0 without a sliding window and max(0, i - W + 1) with window W, and last(i) = i
// for causal attention, so the key at j = i is always visible. Without the causal mask
// (NOTE [Bidirectional attention] in ops/attention.h) last(i) = T - 1. With packed examples
// first(i) is also at least the start of i's example and last(i) at most its end, so no
// token sees another example's. Query head h uses key/value head h / (q_heads / kv_heads).
//
// Forward, one (batch, head, query) row at a time: scores s_j = scale * q.k_j, softmax
// with the row maximum subtracted (exponents <= 0, the sum in double), out = sum_j p_j v_j,
// and lse = max + log(sum) for the backward. Rows are independent and split across threads.
//
// Backward, recomputing p_j = exp(s_j - lse) from the saved lse:
//   dv_j += p_j dout_i      dP_j = dout_i.v_j      D_i = dout_i.out_i
//   dS_j = p_j (dP_j - D_i)     dq_i = scale sum_j dS_j k_j     dk_j += scale dS_j q_i
// D_i = sum_j p_j dP_j is the softmax Jacobian's correction term, read off the forward
// output instead of a second pass over j. Key/value head g collects gradients from every
// query head of its group, so threads own (batch, kv head) pairs: each writes only the dk
// and dv of its kv head and the dq of its query heads, in a fixed loop order
// (NOTE [Deterministic CPU parallelism]).
//
// Memory traffic is not tiled (no flash-attention blocking): the sequences the CPU runs
// are a few hundred tokens, so a row of keys stays in cache.
#include "kernels/cpu/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/attention_row.h"
#include "kernels/cpu/vector_math.h"

namespace forge::cpu {
namespace {

// Element offsets into the packed tensors. A token's row of qkv holds its query heads, key
// heads and value heads one after another.
struct Layout {
  const AttentionDims& d;
  int64_t width;  // elements per token of qkv

  explicit Layout(const AttentionDims& dims)
      : d(dims), width((dims.q_heads + dims.kv_heads) * dims.head_dim + dims.kv_heads * dims.v_head_dim) {}
  int64_t token(int64_t b, int64_t t) const { return (b * d.seq + t) * width; }
  int64_t query(int64_t b, int64_t t, int64_t h) const { return token(b, t) + h * d.head_dim; }
  int64_t key(int64_t b, int64_t t, int64_t g) const { return token(b, t) + (d.q_heads + g) * d.head_dim; }
  int64_t value(int64_t b, int64_t t, int64_t g) const {
    return token(b, t) + (d.q_heads + d.kv_heads) * d.head_dim + g * d.v_head_dim;
  }
  int64_t out_row(int64_t b, int64_t t, int64_t h) const { return ((b * d.seq + t) * d.q_heads + h) * d.v_head_dim; }
  int64_t lse_index(int64_t b, int64_t h, int64_t t) const { return (b * d.q_heads + h) * d.seq + t; }
  int64_t first_key(int64_t b, int64_t i) const {
    int64_t first = d.window > 0 ? std::max<int64_t>(0, i - d.window + 1) : 0;
    return d.example_start ? std::max<int64_t>(first, d.example_start[b * d.seq + i]) : first;
  }
  // The last key of i's example (its row's last without packed examples) when not causal:
  // the tokens after i that share its example's first token.
  int64_t last_key(int64_t b, int64_t i) const {
    if (d.causal) return i;
    if (!d.example_start) return d.seq - 1;
    const int32_t* start = d.example_start + b * d.seq;
    int64_t last = i;
    while (last + 1 < d.seq && start[last + 1] == start[i]) ++last;
    return last;
  }
  int64_t kv_head_of(int64_t h) const { return h / (d.q_heads / d.kv_heads); }
};

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, const AttentionDims& dims) {
  const Layout at(dims);
  int64_t rows = dims.batch * dims.q_heads * dims.seq;
  int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, dims.seq * dims.head_dim));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(dims.seq);
    for (int64_t row = begin; row < end; ++row) {
      int64_t i = row % dims.seq, h = (row / dims.seq) % dims.q_heads, b = row / (dims.seq * dims.q_heads);
      int64_t g = at.kv_head_of(h), first = at.first_key(b, i), last = at.last_key(b, i);
      const double row_lse = attend_row(
          out + at.out_row(b, i, h), qkv + at.query(b, i, h), first, last, dims.scale, dims.head_dim, dims.v_head_dim,
          p.data(),
          [&](int64_t j) { return qkv + at.key(b, j, g); }, [&](int64_t j) { return qkv + at.value(b, j, g); });
      lse[at.lse_index(b, h, i)] = static_cast<float>(row_lse);
    }
  });
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        const AttentionDims& dims) {
  const Layout at(dims);
  const int64_t group = dims.q_heads / dims.kv_heads;
  const int64_t d = dims.head_dim, dv = dims.v_head_dim;
  parallel_for(dims.batch * dims.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      int64_t b = pair / dims.kv_heads, g = pair % dims.kv_heads;
      for (int64_t t = 0; t < dims.seq; ++t) {
        std::fill_n(dqkv + at.key(b, t, g), d, 0.0f);
        std::fill_n(dqkv + at.value(b, t, g), dv, 0.0f);
        for (int64_t h = g * group; h < (g + 1) * group; ++h) std::fill_n(dqkv + at.query(b, t, h), d, 0.0f);
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i = 0; i < dims.seq; ++i) {
          const float* q = qkv + at.query(b, i, h);
          const float* dout_i = dout + at.out_row(b, i, h);
          float* dq = dqkv + at.query(b, i, h);
          float lse_i = lse[at.lse_index(b, h, i)];
          float correction = dot(dout_i, out + at.out_row(b, i, h), dv);
          for (int64_t j = at.first_key(b, i), last = at.last_key(b, i); j <= last; ++j) {
            const float* k = qkv + at.key(b, j, g);
            const float* v = qkv + at.value(b, j, g);
            float p = std::exp(dims.scale * dot(q, k, d) - lse_i);
            float dscore = dims.scale * p * (dot(dout_i, v, dv) - correction);
            axpy(dqkv + at.value(b, j, g), p, dout_i, dv);
            axpy(dqkv + at.key(b, j, g), dscore, q, d);
            axpy(dq, dscore, k, d);
          }
        }
      }
    }
  });
}

}  // namespace forge::cpu
