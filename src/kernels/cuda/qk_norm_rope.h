#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// One stream of a joint attention (ops/qk_norm_rope.h): the joint qkv [batch, seq, 3 heads,
// head_dim], the stream's rows [offset, offset + stream_seq) of it.
struct QkNormRopeProblem {
  int64_t batch, seq, stream_seq, heads, head_dim, offset;
};

// qkv, qkv_in [batch, stream_seq, 3 heads, head_dim] and the weights [head_dim] bf16; rstd
// fp32 [batch, stream_seq, 2 heads]; cos, sin fp32 [seq, head_dim / 2]. head_dim even, at
// most 256.
void qk_norm_rope_forward(bf16* qkv, float* rstd, const bf16* qkv_in, const bf16* q_weight, const bf16* k_weight,
                          float eps, const float* cos, const float* sin, const QkNormRopeProblem& p);
// Overwrites dqkv_in (bf16, qkv_in's shape) from the stream's rows of dqkv (bf16, qkv's
// shape); accumulates dq_weight, dk_weight (fp32 [head_dim]), deterministically.
void qk_norm_rope_backward(bf16* dqkv_in, float* dq_weight, float* dk_weight, const bf16* dqkv, const bf16* qkv_in,
                           const bf16* q_weight, const bf16* k_weight, const float* rstd, const float* cos,
                           const float* sin, const QkNormRopeProblem& p);

}  // namespace forge::cuda
