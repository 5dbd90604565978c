// Attention of a few new query positions over a KV cache (incremental decoding), the
// reference for the CUDA kernel.
//
// Query i of the step sits at absolute position p = position + i and sees the cached keys
// j in [first(p), p], first(p) = max(0, p - W + 1) with a sliding window W, else 0: the
// same keys attention_forward (kernels/cpu/attention.cpp) lets position p see in a full
// sequence. Each (batch, query, head) row is computed exactly as that kernel computes it
// (scores by the same dot product, the maximum subtracted, the sum in double, the output
// accumulated key by key then divided), so the cached decode reproduces the full forward's
// attention to rounding of the inputs. Rows are independent and split across threads.
#include "kernels/cpu/decode_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/attention_row.h"

namespace forge::cpu {
namespace {

struct CacheLayout {
  const DecodeAttentionDims& d;
  int64_t heads() const { return d.q_heads + 2 * d.kv_heads; }
  int64_t qkv_row(int64_t b, int64_t i, int64_t head) const { return ((b * d.queries + i) * heads() + head) * d.head_dim; }
  int64_t cache_row(int64_t b, int64_t t, int64_t g) const { return ((b * d.capacity + t) * d.kv_heads + g) * d.head_dim; }
  int64_t out_row(int64_t b, int64_t i, int64_t h) const { return ((b * d.queries + i) * d.q_heads + h) * d.head_dim; }
};

}  // namespace

void kv_cache_append(float* k_cache, float* v_cache, const float* qkv, const DecodeAttentionDims& dims) {
  CacheLayout at{dims};
  for (int64_t b = 0; b < dims.batch; ++b)
    for (int64_t i = 0; i < dims.queries; ++i)
      for (int64_t g = 0; g < dims.kv_heads; ++g) {
        const int64_t row = at.cache_row(b, dims.position + i, g);
        std::copy_n(qkv + at.qkv_row(b, i, dims.q_heads + g), dims.head_dim, k_cache + row);
        std::copy_n(qkv + at.qkv_row(b, i, dims.q_heads + dims.kv_heads + g), dims.head_dim, v_cache + row);
      }
}

void decode_attention_forward(float* out, const float* qkv, const float* k_cache, const float* v_cache,
                              const DecodeAttentionDims& dims) {
  CacheLayout at{dims};
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
          out + at.out_row(b, i, h), qkv + at.qkv_row(b, i, h), first, last, dims.scale, dims.head_dim,
          dims.head_dim, p.data(),
          [&](int64_t j) { return k_cache + at.cache_row(b, j, g); },
          [&](int64_t j) { return v_cache + at.cache_row(b, j, g); });
    }
  });
}

}  // namespace forge::cpu
