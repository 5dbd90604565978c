#pragma once

#include <cstdint>

namespace forge::cpu {

// The layouts of ops/decode_attention.h: qkv [batch, queries, q_heads + 2 * kv_heads,
// head_dim] holds the new positions position .. position + queries - 1; the caches
// [batch, capacity, kv_heads, head_dim] hold every earlier position; out [batch, queries,
// q_heads, head_dim]. window 0 means no sliding window.
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
};

// Copies the new positions' keys and values from qkv into the caches.
void kv_cache_append(float* k_cache, float* v_cache, const float* qkv, const DecodeAttentionDims& dims);
void decode_attention_forward(float* out, const float* qkv, const float* k_cache, const float* v_cache,
                              const DecodeAttentionDims& dims);

}  // namespace forge::cpu
