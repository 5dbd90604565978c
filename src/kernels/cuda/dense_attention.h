#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// ops/dense_attention.h on the GPU: q [B, Lq, H, D], k [B, Lk, H, D], v [B, Lk,
// H, Dv], out [B, Lq, H, Dv], bias [H, Lq, Lk] or null, all bf16 (any
// alignment, any head dims); Lk >= 1. NOTE [Dense attention on the GPU] in
// dense_attention.cu.
void dense_attention_forward(bf16* out, const bf16* q, const bf16* k, const bf16* v, const bf16* bias, int64_t batch,
                             int64_t q_len, int64_t kv_len, int64_t heads, int64_t head_dim, int64_t v_head_dim,
                             float scale);

}  // namespace forge::cuda
