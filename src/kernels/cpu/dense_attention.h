#pragma once

#include <cstdint>

namespace forge::cpu {

// ops/dense_attention.h's forward on dense row-major buffers: q [B, Lq, H, D],
// k [B, Lk, H, D], v [B, Lk, H, Dv], out [B, Lq, H, Dv], bias [H, Lq, Lk] or
// null; Lk >= 1.
void dense_attention_forward(float* out, const float* q, const float* k, const float* v, const float* bias,
                             int64_t batch, int64_t q_len, int64_t kv_len, int64_t heads, int64_t head_dim,
                             int64_t v_head_dim, float scale);

}  // namespace forge::cpu
