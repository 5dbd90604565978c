// Linear layers: every projection of a model (attention's qkv and o, the feed-forward's
// gate/up and down, the output head) goes through these three ops, with its weight given
// as a LinearWeight descriptor instead of a bare tensor:
//   linear_forward          y  = x W^T            (+ residual, as the GEMM's C operand)
//   linear_backward_input   dx = dy W
//   linear_backward_weight  dW = dy^T x           (written over, or added to, dW)
// x and y are [tokens, features]; W is [out_features, in_features] (Hugging Face layout).
//
// NOTE [Linear weight descriptor]
// A LinearWeight says what a linear layer's weight is, so that the code calling the layer
// never has to. Today that is the weight in the compute dtype (bf16 on the GPU, fp32 on
// the CPU reference). It is the one place where other representations enter: an FP8 copy
// with its scales and recipe state, NF4 codes with their statistics, a LoRA adapter (A, B,
// scale, dropout). (A tensor-parallel shard is not one of them: it is a weight of its own
// shape, NOTE [Tensor-parallel shards] in model/parameters.h, and the collectives around a
// split projection are the components', NOTE [Tensor parallelism] in
// model/tensor_parallel.h.) Each changes what the descriptor holds and
// what these ops do with it, never the block code that calls them. The same type says
// where a layer's gradients go (GradSink hands out LinearWeights of gradient buffers).
// Model code builds no descriptors: it passes on the ones its ParamSource and GradSink
// hand out (model/parameters.h), so a source that wraps another (an FP8 cast, an adapter)
// can fill in what it adds.
//
// NOTE [Linear bias]
// A layer with a bias (FLUX's projections, every one of which has one) sets `bias`: the
// forward adds it to every row of y after the GEMM (and after the residual and any
// adapter's share), and linear_backward_weight writes (or adds) the column sums of dy into
// the gradient descriptor's `bias` (fp32), with the same `overwrite` as the weight. The
// bias is independent of how the weight is held (FP8, NF4, an adapter): it is added in
// the compute dtype after whatever GEMM ran. On CUDA, a plain weight (no FP8, NF4 or
// adapter) gets both from the GEMM itself: the forward's bias in its BIAS epilogue, the
// bias gradient (when written over) in the weight gradient's BGRADB epilogue (NOTE [GEMM
// epilogues] in kernels/cuda/matmul.cpp), with the separate passes where cuBLASLt has no
// fused algorithm.
//
// NOTE [NF4 linear weights]
// A frozen base weight stored as NF4 (QLoRA, NOTE [NF4 storage] in ops/nf4.h) sets `nf4`;
// `weight` is then a scratch buffer [out, in] in the compute dtype (bf16 on the GPU, fp32
// on the CPU) that linear_forward and linear_backward_input dequantize the codes into
// before running the same GEMM as for a plain weight. One buffer, sized for the largest
// projection, can serve every layer: nothing reads it after the op returns. A frozen
// weight has no gradient, so linear_backward_weight refuses an NF4 descriptor. A fused
// projection (qkv, gate_up) keeps one NF4 tensor per Hugging Face weight it stacks, so its
// codes are exactly bitsandbytes' for each.
//
// NOTE [FP8 linear weights]
// A projection trained in FP8 (precision.fp8) sets `fp8`: the three ops then quantize
// their operands and run FP8 GEMMs (NOTE [FP8 tensorwise linear] in ops/fp8_linear.h);
// `weight` stays the compute-dtype weight the codes are cast from, and a gradient
// descriptor's `weight` the fp32 gradient. The settings and the CUDA scratch live in the
// Fp8Projections that wrap the run's ParamSource and GradSink (model/fp8_projections.h),
// which set `fp8` on the block projections they hand out (and on the head when asked);
// model code is the same with or without FP8. NF4 codes too: dequantized into `weight`, then cast
// (NOTE [FP8 over an NF4 base] in model/nf4_base.cpp). With a LoRA adapter (NOTE [FP8 frozen base] in
// model/fp8_projections.h) the base's GEMMs run in FP8 and the adapter's share is added
// in the compute dtype, as without FP8; the gradient descriptor of a frozen weight has no
// `weight`, so there is no FP8 weight gradient.
#pragma once

#include "core/tensor.h"
#include "ops/fp8_linear.h"
#include "ops/nf4.h"

namespace forge {

struct LoraAdapter;        // ops/lora.h
struct LoraExpertAdapter;  // ops/lora_experts.h

struct LinearWeight {
  Tensor weight;  // [out_features, in_features], compute dtype (fp32 for gradients); in a
                  // gradient descriptor undefined when the weight is frozen (no gradient)

  // --- LoRA (NOTE [LoRA linear] in ops/lora.h) ---
  // The low-rank adapter added to this layer, owned by whoever handed the descriptor out;
  // null without one. A gradient descriptor points at the same adapter, whose grad_a /
  // grad_b receive its gradients.
  const LoraAdapter* lora = nullptr;

  // NF4 storage (NOTE [NF4 linear weights]): the codes `weight` is dequantized from, owned
  // by whoever hands out the descriptor; null for a weight held in the compute dtype.
  const Nf4Weight* nf4 = nullptr;

  // FP8 training (NOTE [FP8 linear weights]): the layer's recipe settings and scratch,
  // owned by whoever hands out the descriptor; null for GEMMs in the compute dtype.
  const Fp8Linear* fp8 = nullptr;
  // FSDP's FP8 all-gather (NOTE [FP8 gathered weights] in ops/fp8_linear.h): `weight` is
  // then the E4M3 codes (U8 [out, in]) and this says how they were cast; needs `fp8`.
  const Fp8GatheredWeight* fp8_gathered = nullptr;

  // NOTE [Linear bias]: [out_features], compute dtype (fp32 in a gradient descriptor);
  // undefined for a layer without one (every language model's projection). Last, so that
  // the positional initializers {weight, lora, nf4, fp8} keep their meaning.
  Tensor bias{};

  // A stack of routed experts' matrices [E, out, in] (never a linear op's weight): its LoRA
  // adapters, read by the MoE ops (NOTE [LoRA on routed experts] in ops/lora_experts.h);
  // null without. A gradient descriptor points at the same adapters.
  const LoraExpertAdapter* experts_lora = nullptr;
};

// With an adapter (w.lora) each op adds the adapter's share (ops/lora.h).

// y = x W^T, or y = residual + x W^T with `residual` (shaped and typed like y; may be y
// itself): the residual stream's add costs no pass of its own.
void linear_forward(const Tensor& y, const Tensor& x, const LinearWeight& w, const Tensor* residual = nullptr);

// dx = dy W (written over dx).
void linear_backward_input(const Tensor& dx, const Tensor& dy, const LinearWeight& w);

// dx += dy W: the input gradient added to what dx holds, where several projections read
// the same input (a MoE block's router and shared experts, MLA's two row ranges of kv_a),
// the frozen GEMM's C operand being dx itself. With an adapter its share is added too;
// an NF4 weight is dequantized first; an FP8 one's GEMM adds (fp8_linear_backward_input_add).
void linear_backward_input_add(const Tensor& dx, const Tensor& dy, const LinearWeight& w);

// The weight's gradient dy^T x into `grad`: written over it when `overwrite` (the first
// micro-batch into a fresh buffer, NOTE [Fresh gradient buffers] in model/parameters.h),
// otherwise added to it.
void linear_backward_weight(const LinearWeight& grad, const Tensor& dy, const Tensor& x, bool overwrite);

// Both backward ops of one layer, what a block's backward does with each projection:
// linear_backward_input(dx, dy, w) then linear_backward_weight(grad, dy, x, overwrite),
// with the same results; an FP8 layer without an adapter quantizes dy once for both
// (fp8_linear_backward).
void linear_backward(const Tensor& dx, const LinearWeight& grad, const Tensor& dy, const Tensor& x,
                     const LinearWeight& w, bool overwrite);

// NOTE [GELU after a linear layer]
// An MLP's first layer feeds GELU (tanh): h = x W^T + b, a = gelu_tanh(h), and its backward
// needs h. linear_gelu_forward writes both; on CUDA a plain weight with a bias does it in
// one GEMM (the GELU_AUX_BIAS epilogue, NOTE [GEMM epilogues] in kernels/cuda/matmul.cpp),
// otherwise it is linear_forward then gelu_tanh_forward. linear_gelu_backward is the next
// layer's backward carried through the GELU: for y = a W^T (+ b) it writes
// dh = (dy W) * gelu_tanh'(h) and the next layer's weight (and bias) gradients, written
// over or added to as `overwrite` says; the first layer's backward then takes dh. On CUDA,
// with a plain weight, dh comes out of the dx GEMM (the DGELU epilogue); otherwise dx goes
// into the scratch `da` [rows, in] and GELU's backward is a pass of its own. The results
// are the unfused ops' up to rounding: the fused GEMM applies GELU to the fp32 accumulator
// rather than to h rounded to bf16, and its derivative to the fp32 dx.
void linear_gelu_forward(const Tensor& a, const Tensor& h, const Tensor& x, const LinearWeight& w);
void linear_gelu_backward(const Tensor& dh, const Tensor& da, const LinearWeight& grad, const Tensor& dy,
                          const Tensor& a, const LinearWeight& w, const Tensor& h, bool overwrite);

// NOTE [Linear over concatenated inputs]
// FLUX's single blocks project the concatenation of two tensors along features, the
// attention output x1 [rows, in1] and the MLP's GELU output x2 = gelu_tanh(h2) [rows, in2],
// with one weight W [out, in1 + in2] (Hugging Face layout) and bias b:
//   y = [x1 x2] W^T + b = x1 W1^T + x2 W2^T + b,     W1 = W[:, :in1], W2 = W[:, in1:]
// Copying x1 and x2 into one [rows, in1 + in2] tensor for linear_forward, and its input
// gradient back out of one, costs a pass over both each way (and the copy is kept for the
// weight gradient). These ops take the two inputs apart instead; every GEMM reads (or
// writes) a column block of the weight (of its gradient) in place (NOTE [Column blocks] in
// ops/matmul.h):
//   forward   y = x1 W1^T (+ b, in the GEMM's BIAS epilogue on CUDA), then y += x2 W2^T
//             (the second GEMM's C operand is y, beta 1)
//   backward  dx1 = dy W1;  dh2 = (dy W2) * gelu_tanh'(h2) (the DGELU epilogue on CUDA,
//             otherwise dy W2 into the scratch `da2`, then GELU's backward)
//             dW[:, :in1] = dy^T x1,  dW[:, in1:] = dy^T x2, written over or added to as
//             `overwrite` says; db = the column sums of dy once (the first weight gradient
//             GEMM's BGRADB epilogue on CUDA when written over, otherwise bias_gradient)
// The results are linear_forward's and linear_gelu_backward's on the concatenation up to
// rounding: on the GPU y is rounded to bf16 after the first GEMM and again after the second.
// Only a plain weight: FLUX trains its weights in the compute dtype as they are, so a
// LoRA adapter, FP8 or NF4 on either descriptor is refused with an error naming the op.
void linear_concat_forward(const Tensor& y, const Tensor& x1, const Tensor& x2, const LinearWeight& w);
void linear_concat_gelu_backward(const Tensor& dx1, const Tensor& dh2, const Tensor& da2, const LinearWeight& grad,
                                 const Tensor& dy, const Tensor& x1, const Tensor& x2, const LinearWeight& w,
                                 const Tensor& h2, bool overwrite);

}  // namespace forge
