#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// Multi-head Latent Attention's packed rows (NOTE [MLA packed QKV] in ops/latent_attention.h),
// bf16 with fp32 math: qkv [tokens, W] (written over) from q [tokens, heads (nope + rope)],
// the last rope_dim columns of kv_a [tokens, kv_rank + rope] and kv [tokens, heads (nope + v)],
// tokens = batch * seq; the rope parts rotated by the fp32 tables cos/sin [> max position,
// rope / 2] at position positions[b * seq + t] (int32, device) when given, else t.
// nope_dim, v_dim and kv_rank multiples of 8, rope_dim of 16, every pointer 16-byte aligned
// (checked).
void mla_pack_qkv(bf16* qkv, const bf16* q, const bf16* kv_a, const bf16* kv, int64_t batch, int64_t seq,
                  int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank, const float* cos,
                  const float* sin, const int32_t* positions);

// Its backward: d_q and d_kv written over, d_kv_a's last rope_dim columns written over with
// the heads' key rope gradients summed (fp32, head order: deterministic) and rotated back;
// its first kv_rank columns untouched.
void mla_pack_qkv_backward(bf16* d_q, bf16* d_kv_a, bf16* d_kv, const bf16* d_qkv, int64_t batch, int64_t seq,
                           int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank,
                           const float* cos, const float* sin, const int32_t* positions);

}  // namespace forge::cuda
