#pragma once

#include <cstdint>

namespace forge::cpu {

// The layouts of ops/decode_attention.h, with Dv = v_head_dim (0: head_dim): qkv holds the
// new positions position .. position + queries - 1, per token the q_heads query heads and
// kv_heads key heads of head_dim elements, then the kv_heads value heads of Dv ([batch,
// queries, q_heads + 2 * kv_heads, head_dim] when Dv = head_dim); the caches hold every
// earlier position, keys [batch, capacity, kv_heads, head_dim] and values [batch, capacity,
// kv_heads, Dv]; out [batch, queries, q_heads, Dv]. window 0 means no sliding window.
struct DecodeAttentionDims {
  int64_t batch = 0;
  int64_t queries = 0;
  int64_t capacity = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;
  int64_t position = 0;
  float scale = 0.0f;
  int64_t v_head_dim = 0;  // NOTE [Value head dim] in ops/attention.h; 0: head_dim

  int64_t value_dim() const { return v_head_dim > 0 ? v_head_dim : head_dim; }
};

// Copies the new positions' keys and values from qkv into the caches.
void kv_cache_append(float* k_cache, float* v_cache, const float* qkv, const DecodeAttentionDims& dims);
void decode_attention_forward(float* out, const float* qkv, const float* k_cache, const float* v_cache,
                              const DecodeAttentionDims& dims);

}  // namespace forge::cpu
