#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

struct AttentionProblem {
  int64_t batch, seq, q_heads, kv_heads, head_dim;
  int64_t sliding_window;  // 0: none
  float scale;
};

// qkv bf16 [B, T, Hq + 2 Hkv, D] (packed as the fused projection writes it); out bf16
// [B, T, Hq, D]; lse fp32 [B, Hq, T].
void attention_forward(bf16* out, float* lse, const bf16* qkv, const AttentionProblem& p);
// Overwrites dqkv (same packing as qkv) from dout bf16 [B, T, Hq, D].
void attention_backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const bf16* out, const float* lse,
                        const AttentionProblem& p);

}  // namespace forge::cuda
