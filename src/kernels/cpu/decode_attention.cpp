// Attention of a few new query positions over a KV cache (incremental decoding), the
// reference for the CUDA kernel.
//
// Query i of the step sits at absolute position p = position + i and sees the cached keys
// j in [first(p), p], first(p) = max(0, p - W + 1) with a sliding window W, else 0: the
// same keys attention_forward (kernels/cpu/attention.cpp) lets position p see in a full
// sequence. Each (batch, query, head) row is computed exactly as that kernel computes it
// (scores by the same dot product, the maximum subtracted, the sum in double, the output
// accumulated key by key then divided), so the cached decode reproduces the full forward's
// attention to rounding of the inputs. Queries and keys have head_dim elements, values and
// outputs value_dim() (NOTE [Value head dim] in ops/attention.h: the 3-D qkv form and a value
// cache of its own width); the uniform form is the case value_dim() = head_dim, the same
// layout. Rows are independent and split across threads.
#include "kernels/cpu/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/attention_row.h"

namespace forge::cpu {
namespace {

// Element offsets. A token's row of qkv holds its query heads, key heads and value heads
// one after another; keys have head_dim elements, values dv.
struct CacheLayout {
  const DecodeAttentionDims& d;
  int64_t dv;     // elements of a value head
  int64_t width;  // elements per token of qkv

  explicit CacheLayout(const DecodeAttentionDims& dims)
      : d(dims), dv(dims.value_dim()), width((dims.q_heads + dims.kv_heads) * dims.head_dim + dims.kv_heads * dv) {}
  int64_t token(int64_t b, int64_t i) const { return (b * d.queries + i) * width; }
  int64_t query(int64_t b, int64_t i, int64_t h) const { return token(b, i) + h * d.head_dim; }
  int64_t key(int64_t b, int64_t i, int64_t g) const { return token(b, i) + (d.q_heads + g) * d.head_dim; }
  int64_t value(int64_t b, int64_t i, int64_t g) const {
    return token(b, i) + (d.q_heads + d.kv_heads) * d.head_dim + g * dv;
  }
  int64_t cache_slot(int64_t b, int64_t t, int64_t g) const { return (b * d.capacity + t) * d.kv_heads + g; }
  int64_t k_cache_row(int64_t b, int64_t t, int64_t g) const { return cache_slot(b, t, g) * d.head_dim; }
  int64_t v_cache_row(int64_t b, int64_t t, int64_t g) const { return cache_slot(b, t, g) * dv; }
  int64_t out_row(int64_t b, int64_t i, int64_t h) const { return ((b * d.queries + i) * d.q_heads + h) * dv; }
};

}  // namespace

void kv_cache_append(float* k_cache, float* v_cache, const float* qkv, const DecodeAttentionDims& dims) {
  const CacheLayout at(dims);
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t i = 0; i < dims.queries; ++i)
      for (int64_t g = 0; g < dims.kv_heads; ++g) {
        const int64_t t = dims.position + i;
        std::copy_n(qkv + at.key(b, i, g), dims.head_dim, k_cache + at.k_cache_row(b, t, g));
        std::copy_n(qkv + at.value(b, i, g), at.dv, v_cache + at.v_cache_row(b, t, g));
      }
}

void decode_attention_forward(float* out, const float* qkv, const float* k_cache, const float* v_cache,
                              const DecodeAttentionDims& dims) {
  const CacheLayout at(dims);
  const int64_t rows = dims.batch * dims.queries * dims.q_heads, group = dims.q_heads / dims.kv_heads;
  const int64_t keys = dims.position + dims.queries;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(1, keys * dims.head_dim));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(static_cast<size_t>(keys));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t h = row % dims.q_heads, i = (row / dims.q_heads) % dims.queries;
      const int64_t b = row / (dims.q_heads * dims.queries), g = h / group;
      const int64_t last = dims.position + i;
      const int64_t first = dims.window > 0 ? std::max<int64_t>(0, last - dims.window + 1) : 0;
      attend_row(
          out + at.out_row(b, i, h), qkv + at.query(b, i, h), first, last, dims.scale, dims.head_dim, at.dv, p.data(),
          [&](int64_t j) { return k_cache + at.k_cache_row(b, j, g); },
          [&](int64_t j) { return v_cache + at.v_cache_row(b, j, g); });
    }
  });
}

}  // namespace forge::cpu
