// The queries and keys of a joint-attention stream made ready for attention in one pass
// (FLUX's attention: QK RMSNorm, then rotary embeddings over the three position axes):
// for one stream's fused projection qkv_in [B, Ts, 3H, D] (q heads, then k heads, then v
// heads, as ops/attention.h packs them), writes the rows [offset, offset + Ts) of the joint
// qkv [B, T, 3H, D] that attention reads:
//   q heads:  rstd = 1/sqrt(mean_d x^2 + eps);  x' = x rstd q_weight;  then rotated
//   k heads:  the same with k_weight
//   v heads:  copied
// Rotation is on adjacent pairs (x'[2i], x'[2i+1]) by the angle of joint position
// offset + t, pair i, given as tables cos, sin [T, D/2] (fp32, on the tensors' device):
//   (a, b) -> (a cos - b sin, a sin + b cos)
// which is diffusers' apply_rotary_emb(use_real_unbind_dim=-1) with its repeat-interleaved
// [T, D] tables. FLUX builds the tables from three position axes (model/flux_rope.h); any
// per-token angles work. rstd [B, Ts, 2H] (fp32: the q heads', then the k heads') is saved
// for the backward, which reads the stream's rows of dqkv, OVERWRITES dqkv_in and
// ACCUMULATES the weights' gradients dq_weight, dk_weight [D] (fp32, as ops/rmsnorm.h).
// CPU: qkv, qkv_in, weights fp32. CUDA: qkv, qkv_in, dqkv, dqkv_in, weights bf16.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

void qk_norm_rope_forward(const Tensor& qkv, const Tensor& rstd, const Tensor& qkv_in, const Tensor& q_weight,
                          const Tensor& k_weight, float eps, const Tensor& cos, const Tensor& sin, int64_t offset);
void qk_norm_rope_backward(const Tensor& dqkv_in, const Tensor& dq_weight, const Tensor& dk_weight,
                           const Tensor& dqkv, const Tensor& qkv_in, const Tensor& q_weight, const Tensor& k_weight,
                           const Tensor& rstd, const Tensor& cos, const Tensor& sin, int64_t offset);

}  // namespace forge
