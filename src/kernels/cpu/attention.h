#pragma once

#include <cstdint>

namespace forge::cpu {

// The packed layout of ops/attention.h: per token of qkv the q_heads query heads and the
// kv_heads key heads (head_dim each), then the kv_heads value heads (v_head_dim each), so
// [batch, seq, q_heads + 2 * kv_heads, head_dim] when the two dims agree (NOTE [Value head
// dim]); out [batch, seq, q_heads, v_head_dim], lse [batch, q_heads, seq]. q_heads is a
// multiple of kv_heads; window 0 means no sliding window. example_start, when given, is int32 [batch, seq]:
// the index in its row of the first token of each token's example (packed examples, NOTE
// [Packed examples] in ops/attention.h); a query sees no key before it. Without `causal`
// (NOTE [Bidirectional attention], no window then) a query sees every key of its row, or
// of its example.
struct AttentionDims {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t q_heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;    // of queries and keys
  int64_t v_head_dim = 0;  // of values and out
  int64_t window = 0;
  float scale = 0.0f;
  bool causal = true;
  const int32_t* example_start = nullptr;
};

void attention_forward(float* out, float* lse, const float* qkv, const AttentionDims& dims);
// Overwrites dqkv (same packing as qkv).
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out, const float* lse,
                        const AttentionDims& dims);

}  // namespace forge::cpu
