#pragma once

#include <cstdint>

namespace forge::cpu {

// NOTE [Chunk attention] in ops/attention_chunk.h: `queries` positions [position, position
// + queries) of every sequence, their packed qkv [batch, queries, q_heads + 2 kv_heads,
// head_dim] (query heads read), kv [batch, kv_seq, 2 kv_heads, head_dim] (key heads, then
// value heads), out [batch, queries, q_heads, head_dim], lse [batch, q_heads, queries].
// q_heads is a multiple of kv_heads; window 0 means no sliding window. example_start: null,
// or packed examples as int32 [batch, kv_seq], each position's example's first position (NOTE
// [Chunk attention with packed examples]).
struct AttentionChunkDims {
  int64_t batch = 0;
  int64_t queries = 0;
  int64_t position = 0;
  int64_t kv_seq = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t window = 0;
  float scale = 0.0f;
  const int32_t* example_start = nullptr;
  bool causal = true;
  // Not causal, packed examples: int32 [batch, queries], the first key of kv each query sees
  // (kv_seq: none; NOTE [Full chunk attention with packed examples]).
  const int32_t* first_key = nullptr;
};

void attention_chunk_forward(float* out, float* lse, const float* qkv, const float* kv, const AttentionChunkDims& dims);
// Overwrites dqkv's query heads (not its key/value heads) and all of dkv.
void attention_chunk_backward(float* dqkv, float* dkv, const float* dout, const float* qkv, const float* kv,
                              const float* out, const float* lse, const AttentionChunkDims& dims);

}  // namespace forge::cpu
