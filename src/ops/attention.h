// Causal grouped-query attention on the packed output of the fused QKV projection.
//
// qkv is [B, T, Hq + 2*Hkv, D]: heads [0, Hq) are queries, [Hq, Hq+Hkv) keys, and
// [Hq+Hkv, Hq+2*Hkv) values. Query head h reads key/value head h / (Hq / Hkv), so K and V
// are never copied up to the query heads. Query position i sees key position j when
// j <= i (causal) and, with a sliding window W > 0, i - j < W (Mistral 7B v0.1).
//   out[b,i,h,:] = sum_j softmax_j(scale * q.k_j) v_j      out is [B, T, Hq, D]
//   lse[b,h,i]   = log sum_j exp(scale * q.k_j)           lse is [B, Hq, T], fp32
// The backward recomputes probabilities from lse and overwrites dqkv (same packing).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

struct AttentionShape {
  int64_t num_q_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t sliding_window = 0;  // 0: unlimited
  float scale = 0.0f;          // usually 1/sqrt(head_dim)
};

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const AttentionShape& shape);
void attention_backward(const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                        const Tensor& lse, const AttentionShape& shape);

}  // namespace forge
