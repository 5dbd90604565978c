#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// The layouts of ops/decode_attention.h, with Dv = v_head_dim (0: head_dim): qkv bf16, per
// token the q_heads query heads and kv_heads key heads of head_dim elements, then the
// kv_heads value heads of Dv ([batch, queries, q_heads + 2 kv_heads, head_dim] when
// Dv = head_dim), for positions position .. position + queries - 1; caches bf16, keys
// [batch, capacity, kv_heads, head_dim] and values [batch, capacity, kv_heads, Dv]; out bf16
// [batch, queries, q_heads, Dv]. head_dim and Dv at most 256.
struct DecodeAttentionProblem {
  int64_t batch, queries, capacity, q_heads, kv_heads, head_dim;
  int64_t sliding_window;  // 0: none
  int64_t position;
  float scale;
  int64_t v_head_dim;  // NOTE [Value head dim] in ops/attention.h; 0: head_dim
};

void kv_cache_append(bf16* k_cache, bf16* v_cache, const bf16* qkv, const DecodeAttentionProblem& p);
void decode_attention_forward(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                              const DecodeAttentionProblem& p);

}  // namespace forge::cuda
