#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// The layouts of ops/decode_attention.h: qkv bf16 [batch, queries, q_heads + 2 kv_heads,
// head_dim] for positions position .. position + queries - 1; caches bf16 [batch,
// capacity, kv_heads, head_dim]; out bf16 [batch, queries, q_heads, head_dim].
struct DecodeAttentionProblem {
  int64_t batch, queries, capacity, q_heads, kv_heads, head_dim;
  int64_t sliding_window;  // 0: none
  int64_t position;
  float scale;
};

void kv_cache_append(bf16* k_cache, bf16* v_cache, const bf16* qkv, const DecodeAttentionProblem& p);
void decode_attention_forward(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                              const DecodeAttentionProblem& p);

}  // namespace forge::cuda
