#pragma once

#include <cstdint>

namespace forge::cpu {

// Multi-head Latent Attention's packed rows (NOTE [MLA packed QKV] in ops/latent_attention.h),
// fp32, for batch * seq tokens of `heads` heads with nope_dim, rope_dim and v_dim dims:
// qkv [tokens, W] (written over) from q [tokens, heads (nope + rope)], the last rope_dim
// columns of kv_a [tokens, kv_rank + rope] and kv [tokens, heads (nope + v)]; the rope parts
// rotated by cos/sin [> max position, rope / 2] at position positions[b * seq + t] when
// given, else t.
void mla_pack_qkv(float* qkv, const float* q, const float* kv_a, const float* kv, int64_t batch, int64_t seq,
                  int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank, const float* cos,
                  const float* sin, const int32_t* positions);

// Its backward: d_q and d_kv written over, d_kv_a's last rope_dim columns written over with
// the heads' key rope gradients summed (fp32, head order) and rotated back; its first
// kv_rank columns untouched.
void mla_pack_qkv_backward(float* d_q, float* d_kv_a, float* d_kv, const float* d_qkv, int64_t batch, int64_t seq,
                           int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim, int64_t kv_rank,
                           const float* cos, const float* sin, const int32_t* positions);

}  // namespace forge::cpu
