// LoRA adapters on a Mixture-of-Experts block's routed experts: one low-rank update per
// expert of a stacked weight [E, out, in] (the experts' gate/up [E, 2F, H] or down
// [E, H, F]), as Hugging Face PEFT 0.21's ParamWrapper adapts transformers 5's stacked
// parameters (target_parameters mlp.experts.gate_up_proj / mlp.experts.down_proj).
//
// NOTE [LoRA on routed experts]
// PEFT's ParamWrapper on a 3-D parameter [E, out, in] (transformers 5's MixtralExperts and
// DeepseekV3NaiveMoe layout, not transposed) holds lora_A [E r, in] and lora_B [out, r E]
// and adds to expert e's weight
//   Delta_e = scale * B_e A_e,   A_e = lora_A[e r : (e+1) r, :],   B_e[o, k] = lora_B[o, k E + e],
// scale = alpha / r (einsum "o r e, e r i -> e o i" in get_delta_weight): A's rows are
// expert-major, B's columns rank-major. It takes no dropout (PEFT raises on lora_dropout > 0).
// PEFT 0.21's all-linear on a MoE model (its v4-to-v5 conversion of the experts' w1 and w3,
// two rank-r adapters, into one on the fused stack) gives gate_up_proj rank 2 r and alpha
// 2 alpha (rank_pattern, alpha_pattern), the scale unchanged; forge's all-linear does the same
// (LoraTarget::rank_multiple in model/lora.h), its named experts.gate_up_proj takes rank r, as
// PEFT's target_parameters does.
// forge keeps A as PEFT does and B expert-major, b [E out, r] with B_e its rows
// [e out, (e+1) out), so that each expert's A_e and B_e are contiguous matrices (and a
// rank's local experts, under expert parallelism, a contiguous slice of both); the PEFT
// adapter reader and writer permute B's columns (model/lora.cpp, LoraAdapters::part_matrix).
// The update runs as separate low-rank GEMMs on each expert's rows, after the frozen
// expert GEMM, not by materializing W_e + scale B_e A_e:
//   forward          u_e = x_e A_e^T [rows, r];   y_e += scale * u_e B_e^T
//   backward input   g_e = dy_e B_e [rows, r];    dx_e += scale * g_e A_e
//   backward weight  dA_e = scale * g_e^T x_e;    dB_e = scale * dy_e^T u_e (u_e recomputed)
// Why not materialize: the merged weight would need a scratch the size of an expert's
// matrices for the forward and another (fp32) for the weight gradient's dW_e, then GEMMs of
// [out, in] x r to fold dW_e into dA_e and dB_e, per expert and per pass: out x in x r
// multiply-adds per expert however few rows it has, against rows x (in + out) x r here
// (an expert sees a few hundred to a few thousand rows, its matrices are thousands wide).
// The low-rank form also leaves the frozen GEMM untouched, whatever it reads (the NF4
// base's dequantized stacks, NOTE [NF4 expert stacks] in model/nf4_base.h, or a later FP8
// expert GEMM), keeps nothing between forward and backward (u is recomputed, as NOTE
// [LoRA linear]'s adapters do), and is exactly PEFT's function in exact arithmetic. The
// GEMMs whose row count changes with the routing are matmul_varying's (NOTE [GEMMs of
// varying size]). An expert with no rows adds nothing, and its gradients are zero when
// the backward writes over them.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/moe.h"

namespace forge {

// Scratch of the expert adapters, shared by every expert adapter of a model: [rows, rank]
// twice in the compute dtype, rows the most permuted rows one expert GEMM call sees.
struct LoraExpertWorkspace {
  Tensor low_rank, low_rank_grad;  // flat
};

// The adapters of one stacked expert weight, as the MoE ops read them. A weight descriptor
// (LinearWeight::experts_lora) points at it for the forward and the input gradient; a
// gradient descriptor at the same object, whose grad_a / grad_b receive the gradients.
struct LoraExpertAdapter {
  Tensor a;               // [experts * rank, in], compute dtype: expert e's A_e in rows [e r, (e+1) r)
  Tensor b;               // [experts * out, rank], compute dtype: expert e's B_e in rows [e out, (e+1) out)
  Tensor grad_a, grad_b;  // fp32, shaped as a and b; undefined where no gradient is wanted
  int64_t rank = 0, experts = 0;
  float scale = 1.0f;  // alpha / rank
  LoraExpertWorkspace* workspace = nullptr;

  int64_t out() const { return experts > 0 ? b.dim(0) / experts : 0; }
  int64_t in() const { return a.dim(1); }
};

// y [rows, out] += each expert's update on its rows of x [rows, in] (the routing's offsets).
void lora_experts_forward_add(const Tensor& y, const Tensor& x, const LoraExpertAdapter& lora,
                              const MoeRouting& routing);
// dx [rows, in] += each expert's update's input gradient from dy [rows, out].
void lora_experts_backward_input_add(const Tensor& dx, const Tensor& dy, const LoraExpertAdapter& lora,
                                     const MoeRouting& routing);
// lora.grad_a / grad_b (written over when `overwrite`, else added) from dy and x.
void lora_experts_backward_weight(const LoraExpertAdapter& lora, const Tensor& dy, const Tensor& x,
                                  const MoeRouting& routing, bool overwrite);

// The MoE backward's hook: dx += the input gradient through `weights` (null: no adapter),
// then the adapters' gradients into `grads`' buffers (null: none).
void lora_experts_backward(const Tensor& dx, const Tensor& dy, const Tensor& x, const LoraExpertAdapter* weights,
                           const LoraExpertAdapter* grads, const MoeRouting& routing, bool overwrite);

}  // namespace forge
