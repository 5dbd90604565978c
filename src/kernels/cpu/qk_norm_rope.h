#pragma once

#include <cstdint>

namespace forge::cpu {

// One stream of a joint attention (ops/qk_norm_rope.h): qkv [batch, seq, 3 heads, head_dim]
// the joint tensor, the stream's rows [offset, offset + stream_seq) of it; qkv_in and dqkv_in
// [batch, stream_seq, 3 heads, head_dim]; rstd [batch, stream_seq, 2 heads]; weights [head_dim];
// cos, sin [seq, head_dim / 2].
struct QkNormRopeDims {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t stream_seq = 0;
  int64_t heads = 0;
  int64_t head_dim = 0;
  int64_t offset = 0;
};

void qk_norm_rope_forward(float* qkv, float* rstd, const float* qkv_in, const float* q_weight, const float* k_weight,
                          float eps, const float* cos, const float* sin, const QkNormRopeDims& dims);
// Overwrites dqkv_in; accumulates dq_weight, dk_weight.
void qk_norm_rope_backward(float* dqkv_in, float* dq_weight, float* dk_weight, const float* dqkv,
                           const float* qkv_in, const float* q_weight, const float* k_weight, const float* rstd,
                           const float* cos, const float* sin, const QkNormRopeDims& dims);

}  // namespace forge::cpu
