// Multi-head Latent Attention (DeepSeek-V2/V3): the op that assembles the packed Q/K/V
// rows the attention op reads from the three projections MLA computes per token, applying
// the rotary embedding to the decoupled rotary part on the way.
//
// NOTE [MLA packed QKV]
// With H heads, a no-rope part of dn dims, a rotary part of dr dims and value dims dv, MLA
// computes for each token (transformers' DeepseekV3Attention):
//   q    [H, dn + dr]     from q_proj (or q_a -> norm -> q_b): each head q_nope | q_pe;
//   kv_a [kv_rank + dr]   from kv_a_proj_with_mqa: the compressed kv (kv_rank columns,
//                         normalized and expanded by kv_b elsewhere), then k_pe, ONE rotary
//                         key shared by every head;
//   kv   [H, dn + dv]     from kv_b_proj: each head k_nope | v.
// The packed row of a token, W = H (dn + dr) + H (dn + dr) + H dv wide, is
//   [ q_nope_h | rope(q_pe_h) ]  for h < H     the query heads
//   [ k_nope_h | rope(k_pe)   ]  for h < H     the key heads, k_pe broadcast to each
//   [ v_h ]                      for h < H     the value heads
// where rope is ops/rope.h's rotation ("rotate half": pairs (x[i], x[i + dr/2]) rotated by
// position * inv_freq[i]) from the cos/sin tables [positions, dr/2] of rope_tables, at the
// token's position (t, or the given one: NOTE [Packed examples] in ops/attention.h).
// The op is linear in q, kv_a and kv. Its backward copies the nope and value gradients
// back, rotates the query rope gradients back (the inverse rotation, as rope_backward),
// and gives k_pe the sum over heads of its H copies' gradients, rotated back: summed first
// (a rotation is linear), in fp32, in head order, so the result is the same bits every run.
// DeepSeek's checkpoints lay q_pe and k_pe out in interleaved pairs (x[2i], x[2i + 1])
// (transformers' rope_interleave, apply_rotary_pos_emb_interleave), whose rotation outputs
// exactly what rotate-half gives on the de-interleaved vector; an importer that permutes
// the rope rows of q_b_proj and kv_a_proj_with_mqa that way (row j from row 2j for
// j < dr/2, from row 2(j - dr/2) + 1 after) makes this op compute the same.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

// MLA's head dimensions (DeepSeek-V2/V3: nope_dim 128, rope_dim 64, v_dim 128, kv_rank 512).
struct MlaDims {
  int64_t heads = 0;
  int64_t nope_dim = 0;  // dn: the query/key dims without rotary embedding
  int64_t rope_dim = 0;  // dr: the decoupled rotary dims (even)
  int64_t v_dim = 0;     // dv
  int64_t kv_rank = 0;   // the compressed kv's width: kv_a's columns before k_pe
  int64_t qk_dim() const { return nope_dim + rope_dim; }
  // W: the packed row's width, H (dn + dr) query + H (dn + dr) key + H dv value columns.
  int64_t packed_width() const { return heads * (2 * qk_dim() + v_dim); }
};

// qkv [B, T, W] (written over) from q [B*T, H (dn + dr)], kv_a [B*T, kv_rank + dr] (only
// its last dr columns, k_pe, are read) and kv [B*T, H (dn + dv)] (NOTE [MLA packed QKV]).
// cos/sin: rope_tables' fp32 tables [> max position, dr/2] on the tensors' device.
// positions: int32 [B, T] on that device, each token's position; null: position t for
// token t of every row. Positions must index rows of the tables (checked on the CPU; on
// CUDA the caller's duty, as for rope_forward).
void mla_pack_qkv(const Tensor& qkv, const Tensor& q, const Tensor& kv_a, const Tensor& kv, const MlaDims& dims,
                  const Tensor& cos, const Tensor& sin, const Tensor* positions = nullptr);

// From d_qkv [B, T, W]: d_q [B*T, H (dn + dr)] and d_kv [B*T, H (dn + dv)] (written over),
// and the last dr columns of d_kv_a [B*T, kv_rank + dr] (written over: the sum over heads
// of the key rope gradients, rotated back); d_kv_a's first kv_rank columns are left alone
// (the kv_a norm's backward writes them).
void mla_pack_qkv_backward(const Tensor& d_q, const Tensor& d_kv_a, const Tensor& d_kv, const Tensor& d_qkv,
                           const MlaDims& dims, const Tensor& cos, const Tensor& sin,
                           const Tensor* positions = nullptr);

}  // namespace forge
