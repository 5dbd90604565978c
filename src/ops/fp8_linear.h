// A linear layer's three GEMMs in FP8 with current (just-in-time) tensorwise scaling, as
// torchao's "tensorwise" recipe and Transformer Engine's Float8CurrentScaling. The linear
// ops (ops/linear.h) call these for a descriptor whose `fp8` is set.
//
// NOTE [FP8 tensorwise linear]
// Each GEMM quantizes both operands from the tensors at hand: amax = max |t|, scale =
// torchao's amax_to_scale(amax) (fp8_max / amax, not rounded to a power of 2; NOTE [FP8
// scaling recipes] in kernels/cpu/fp8_scaling.h), codes = cast_saturated(t * scale); the
// GEMM multiplies the codes with fp32 accumulation and applies the two inverse scales:
//   forward         y  = x W^T    x E4M3, W E4M3          (+ residual)
//   input gradient  dx = dy W     dy in the grad format, W E4M3
//   weight gradient dW = dy^T x   dy in the grad format, x E4M3   (written over or added to)
// The grad format is E5M2 by default (precision.fp8_grad_format), E4M3 on request.
// On the CPU (fp32 tensors) this is the reference: quantization with kernels/cpu/fp8_scaling,
// the codes decoded to fp32 (exactly), the fp32 GEMM of ops/matmul.h on them with alpha =
// the product of the two inverse scales and beta 1 for the residual or the gradient
// already there: what the GPU's FP8 GEMM computes, up to summation order. On CUDA (bf16 x, W, y, dy, dx; fp32 dW): the
// device amax, scale and saturating cast of kernels/cuda/fp8_cast (the amax and scales
// never leave the device, nothing synchronizes the host), cast + transpose where Hopper's
// TN-only FP8 GEMM needs the other major-ness (NOTE [FP8 GEMM layout] in
// kernels/cuda/fp8_matmul.h), and cuBLASLt's scaled FP8 GEMM with bf16 output for y and
// dx (the residual as C with beta = 1) and fp32 output for dW (beta 0 or 1). The forward
// GEMM uses Hopper's fast FP8 accumulation, the two backward GEMMs do not, as torchao.
// A non-finite amax is not refused here: it gives a NaN or zero scale, exactly as torchao;
// with a statistics block (Fp8Linear::stats) every cast folds its amax into the block, and
// the trainer names the first non-finite one at the step's end (NOTE [FP8 step end] in
// model/fp8_projections.h). The amax of x and dy comes from the kernels that produce them
// where forge writes those (NOTE [FP8 fused producers]); the weights are cast once per
// optimizer step (NOTE [FP8 weight cache]).
// What is recomputed: every GEMM casts its operands again (x in the forward and the weight
// gradient, W in the forward and the input gradient); the codes and scales are identical
// each time, since the same tensor gives the same amax. dy is quantized once for both
// backward GEMMs when they come as one call (fp8_linear_backward, which the blocks use
// through linear_backward): one amax and one cast that writes dy's codes and their
// transpose together, the same codes the two separate ops produce.
//
// NOTE [FP8 forward statistics]
// The backward GEMMs quantize the x and W the forward quantized: the activations kept for
// the backward (or recomputed bitwise by activation checkpointing) and the weights, which
// change only at the optimizer step. So their amax and scales are the forward's, and a
// projection with an Fp8ForwardStats (CUDA; one per projection, Fp8Projections) keeps them
// there from its forward and its backward skips the two amax passes. The backward reuses
// them only for the same tensors (data pointer and size) the last forward saw, and computes
// them otherwise (a backward with no forward before it, the head's chunks): the codes are
// the same either way, bit for bit.
//
// NOTE [FP8 padded token contraction]
// The weight gradient dW = dy^T x contracts over the tokens, which Hopper's FP8 GEMM wants
// a multiple of 16 (NOTE [FP8 GEMM layout] in kernels/cuda/fp8_matmul.h). A dense
// projection's tokens are the micro-batch's, which configs make a multiple of 16; a routed
// expert's are the rows the routing gave it (NOTE [FP8 routed experts] in ops/moe_fp8.h),
// any number. On CUDA, for t not a multiple of 16, fp8_linear_backward_weight quantizes
// dy^T [out, t] and x^T [in, t] as always (the same amaxes and scales: a zero row would not
// change an amax either), each into the third code buffer, and copies them into the first
// two as [out, t16] and [in, t16] with zero codes in the added columns
// (kernels/cuda/fp8_padding.h): zero tokens, which add nothing, so the GEMM over t16 is the
// one over t. The forward and the input gradient do not contract over the tokens and need
// nothing. The CPU reference has no such constraint and multiplies the t rows as they are.
//
// NOTE [FP8 delayed scaling]
// precision.fp8 delayed (Transformer Engine's DelayedScaling): a projection with `delayed`
// set quantizes x, W and dy with the scales its statistics block holds, which the step
// before computed from each role's amax history (kernels/cpu/fp8_scaling.h), and folds the
// amax of what it casts into the role's `seen` in the same pass: no amax pass before the
// cast, the saving delayed scaling exists for. The GEMM's factors are the block's scale_inv.
// model/fp8_projections.h runs the once-per-step update. On the CPU, the same with the
// block in host memory.
#pragma once

#include "core/tensor.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/fp8_scaling.h"
#include "kernels/cuda/fp8_epilogue.h"
#include "ops/fp8_amax_group.h"

namespace forge {

using cpu::Fp8Format;

// Hopper's FP8 GEMMs contract over multiples of this (NOTE [FP8 padded token contraction]).
constexpr int64_t kFp8TokenMultiple = 16;

// Device scratch of the CUDA path, shared by every FP8 layer of a model (they run one after
// another): three code buffers, each at least max(tokens x in, tokens x out, out x in) bytes
// over the layers (the third holds dy's transpose in fp8_linear_backward), and 6 fp32 values (amax, scale, inverse scale of each operand), each at
// its own 256-byte boundary (kFp8StatStride): cuBLASLt reads the inverse scales through
// pointers, and the H100 refused (CUBLAS_STATUS_NOT_SUPPORTED at the matmul, after the
// heuristic had found an algorithm) a GEMM whose scale pointers were 8 and 20 bytes into one
// allocation (GpuFp8Gemm.ScalePointerAlignment probes the offsets). Unused on the CPU.
using cpu::kFp8StatStride;  // floats: 256 bytes
constexpr int64_t kFp8WorkspaceStats = 6 * kFp8StatStride;
struct Fp8LinearWorkspace {
  Tensor a_codes, b_codes, c_codes;  // U8, flat
  Tensor stats;             // F32 [kFp8WorkspaceStats]
  Tensor nf4_stats;         // F32 [3 * kFp8StatStride], optional: NOTE [FP8 straight from NF4] in ops/nf4_fp8.h
};

// A layer's FP8 settings, owned by whoever hands out the descriptor (model/fp8_projections.h).
// One projection's statistics from its last forward (NOTE [FP8 forward statistics]).
struct Fp8ForwardStats {
  float* device = nullptr;  // x's amax, scale and inverse scale, then W's: kFp8WorkspaceStats floats
  const void* x = nullptr;  // the tensors the last forward quantized, by data pointer and size
  const void* w = nullptr;
  int64_t x_numel = 0, w_numel = 0;
};

// NOTE [FP8 weight cache]
// A weight changes only at the optimizer step, so its codes (W for the forward, W^T for the
// input gradient) are the same in every micro-batch of a step. With a cache (CUDA,
// precision.fp8_weight_cache) a projection casts W and W^T into its own buffers the first
// time a step needs them and reuses them until `*generation` (bumped by Fp8Projections at
// every step's end, before the optimizer changes the weights) moves on: at accum N the
// weights are cast once instead of N times (plus recomputation's forwards). The codes are
// the same bytes either way, so results are bitwise those without the cache. A cache entry
// belongs to one weight tensor (data pointer and size); anything else is cast as before. The
// scales travel with the codes: tensorwise's in the projection's forward statistics (which
// the caching cast wrote), delayed's in its statistics block. Costs 2 bytes per weight.
struct Fp8WeightCache {
  Tensor codes, codes_t;                // U8 [out * in]: W and W^T
  const uint64_t* generation = nullptr;  // the step the codes must be from
  const void* w = nullptr;              // the weight they were cast from
  int64_t numel = 0;
  uint64_t codes_of = ~uint64_t{0}, codes_t_of = ~uint64_t{0};  // the generation each was cast in
};

// NOTE [FP8 fused producers]
// Quantizing a projection's x (and, in the backward, its dy) starts with a pass over the
// tensor: its amax (tensorwise) or its cast (delayed). Where a kernel of forge's own writes
// that tensor just before the projection reads it, the kernel does that pass on the values
// it holds in registers (kernels/cuda/fp8_epilogue.h): RMSNorm's output for the qkv and
// gate/up projections, SwiGLU's output for the down projection (the blocks pass the
// consumer's descriptor to the producing op), and SwiGLU's backward output, the gate/up
// projection's dy. With `tensorwise` the producer folds x's amax into the projection's
// forward statistics (dy's into the shared workspace's) and the GEMM's quantization then
// only computes the scale and casts; with `delayed` the producer also writes x's E4M3
// codes with the role's delayed scale into the workspace, folding the amax into the role's
// `seen`, and the forward does no cast of x at all (dy under `delayed` has no amax pass to
// save: its cast already folds it, and it writes dy's transpose too, which an elementwise
// producer cannot). The producer records what it did, for which tensor (data pointer and
// size), in the projection's Fp8Produced; the next quantization of that very tensor uses it
// once and clears it, anything else quantizes as before. The amax and codes are computed
// from the bf16 values as stored, so every code, scale and result is bitwise the unfused
// path's (GpuFp8Linear.FusedProducersGiveTheSameBits). What it saves on the 8B-shape proxy:
// one read of x for qkv, gate/up and down and of dy for gate/up: 0.83 GB per layer and
// micro-batch under tensorwise, 0.36 GB under delayed (docs/PERF.md). The attention output
// (cuDNN) and the residual-stream gradients (the o and down projections' dy) are made by
// kernels that cannot take the epilogue, and keep their passes. CUDA only: on the CPU the
// reference quantizes every tensor itself.
struct Fp8Produced {
  const void* x = nullptr;  // the forward input a producer prepared, by data pointer and size
  int64_t x_numel = 0;
  bool x_codes = false;      // its codes too (delayed), in the workspace's a_codes
  const void* dy = nullptr;  // the output gradient whose amax is in the workspace's first slot
  int64_t dy_numel = 0;
  // Where x's codes are when not in the workspace's a_codes: a routed expert's rows, cast
  // with every other expert's by the grouped casts (NOTE [FP8 grouped expert casts] in
  // kernels/cuda/fp8_grouped_cast.cu), which also prepare them under `tensorwise` (the
  // scales then in the projection's forward statistics).
  const uint8_t* x_codes_at = nullptr;
  // Where dy's amax, scale and inverse scale are (kFp8StatStride apart), all three done, when
  // not the amax alone in the workspace's first slot: a routed expert's output gradient,
  // whose statistics the grouped amax and scales computed with every other expert's
  // (tensorwise; NOTE [FP8 grouped expert casts]). Only fp8_linear_backward takes it.
  float* dy_stats_at = nullptr;
};

// NOTE [FP8 gathered weights]
// Under FSDP with precision.fp8_fsdp_all_gather (NOTE [FP8 all-gather] in
// distributed/fsdp.h) a projection's weight arrives already quantized: the ops' `w` is then
// its E4M3 codes (U8 [out, in]) and an Fp8GatheredWeight says how they were cast. The ops
// use them as a weight-cache hit: the forward casts no W and takes the codes and their
// inverse scale; the input gradient's W^T is the codes transposed (fp8_transpose_codes,
// into the scratch's W buffer); every use folds `amax` into the W role's `seen`, as a
// cast of W would. On the CPU the reference decodes the codes to fp32 (exactly). The codes
// and scale are the bf16-gather path's (same amax, same scale function, same cast), so
// the results are bitwise the same. One per piece (NOTE [FP8 all-gather pieces], distributed/).
struct Fp8GatheredWeight {
  const float* amax = nullptr;       // the whole piece's; delayed: of its part in this rank's chunk (0: none)
  const float* scale = nullptr;      // the scale the codes were cast with
  const float* scale_inv = nullptr;  // its inverse, the GEMM's factor (256-byte aligned on CUDA)
};

// The bit of Fp8Linear::amax_group_roles for a role.
constexpr uint8_t fp8_role_bit(cpu::Fp8Role role) { return static_cast<uint8_t>(1u << static_cast<unsigned>(role)); }

struct Fp8ExpertStack;  // ops/moe_fp8.h

// NOTE [FP8 weight gradient switch]
// precision.fp8_weight_gradient false (Fp8Linear::weight_gradient) keeps a projection's
// forward and input-gradient GEMMs in FP8 and runs its weight gradient dW (+)= dy^T x in the
// compute dtype, from the unquantized dy and x the backward holds anyway, as Megatron-LM's
// --no-fp8-wgrad and Transformer Engine's override_linear_precision=(False, False, True) do:
// the weight gradients, and so the optimizer's updates, carry no FP8 rounding of dy and x,
// at the price of a third of the FP8 GEMM work back at the bf16 rate. dy is cast once, row
// major for the input gradient (no transpose, no x^T cast; the CUDA scratch's third code
// buffer is not allocated), and its amax, scale and every statistic are the FP8 weight
// gradient's: the switch changes no checkpointed state. dx is bitwise fp8_linear_backward's
// and dW bitwise the compute dtype's matmul (tests/cpu/test_fp8_weight_gradient.cpp). The
// micro-batch's tokens are then contracted by no FP8 GEMM, so CUDA no longer asks that they be
// a multiple of 16, as for a frozen LoRA base.
struct Fp8Linear {
  Fp8Format grad_format = Fp8Format::E5M2;
  Fp8LinearWorkspace* workspace = nullptr;  // required on CUDA
  Fp8ForwardStats* forward = nullptr;       // CUDA, optional: this projection's own (tensorwise)
  // Optional: this projection's statistics block (kFp8ProjectionStats floats on the tensors'
  // device, NOTE [FP8 projection statistics] in kernels/cpu/fp8_scaling.h). Every
  // quantization folds its tensor's amax into the role's `seen`.
  float* stats = nullptr;
  // Quantize with the scales in `stats` (NOTE [FP8 delayed scaling]) instead of current ones.
  bool delayed = false;
  Fp8WeightCache* weight_cache = nullptr;  // CUDA, optional: NOTE [FP8 weight cache]
  Fp8Produced* produced = nullptr;         // CUDA, optional: NOTE [FP8 fused producers]
  // CUDA: the token count changes from call to call (a routed expert's rows), so the GEMMs
  // keep their plans per bucket of it (NOTE [FP8 GEMMs of varying size] in
  // kernels/cuda/fp8_matmul.cpp).
  bool varying_tokens = false;
  // Optional: the group over which the amax of each role in amax_group_roles (fp8_role_bit)
  // is max-reduced before a current scale is computed from it (not with delayed scales,
  // which the trainer agrees at the step's end).
  Fp8AmaxGroup* amax_group = nullptr;
  uint8_t amax_group_roles = 0;
  // A routed-expert stack's per-expert state (NOTE [FP8 expert stack state] in
  // ops/moe_fp8.h): each expert's forward statistics, weight cache and grouped casts.
  Fp8ExpertStack* experts = nullptr;
  bool weight_gradient = true;  // NOTE [FP8 weight gradient switch]: false, dW in the compute dtype
};

// The role's `seen` in the projection's statistics block, or null without one.
inline float* fp8_seen_of(const Fp8Linear& fp8, cpu::Fp8Role role) {
  return fp8.stats ? fp8.stats + cpu::fp8_seen_offset(0, role) : nullptr;
}

// Whether the layer quantizes with its block's delayed scales (NOTE [FP8 delayed scaling]).
inline bool fp8_uses_delayed_scales(const Fp8Linear& fp8) { return fp8.delayed && fp8.stats; }

// The group a role's current amax is max-reduced over before its scale (NOTE [FP8 under
// tensor parallelism] in model/fp8_projections.h), or null.
inline Fp8AmaxGroup* fp8_amax_group_of(const Fp8Linear& fp8, cpu::Fp8Role role) {
  return fp8.amax_group && (fp8.amax_group_roles & fp8_role_bit(role)) != 0 ? fp8.amax_group : nullptr;
}

// NOTE [FP8 fused producers]: the epilogue for the kernel about to write x, which the
// projection with these FP8 settings quantizes next in its forward; inactive (nothing to
// do) on the CPU, without settings or without `produced`. Records what the epilogue will do.
cuda::Fp8Epilogue fp8_input_epilogue(const Tensor& x, const Fp8Linear* consumer);
// The same for the kernel about to write dy, the projection's output gradient: where its
// amax goes (tensorwise), or null.
float* fp8_output_gradient_amax(const Tensor& dy, const Fp8Linear* consumer);

// With `gathered`, w is the weight's E4M3 codes (NOTE [FP8 gathered weights]).
void fp8_linear_forward(const Tensor& y, const Tensor& x, const Tensor& w, const Fp8Linear& fp8,
                        const Tensor* residual, const Fp8GatheredWeight* gathered = nullptr);
void fp8_linear_backward_input(const Tensor& dx, const Tensor& dy, const Tensor& w, const Fp8Linear& fp8,
                               const Fp8GatheredWeight* gathered = nullptr);
// dx += dy W: the input gradient added to what dx holds (beta 1 in the same GEMM), where
// several projections read one input (linear_backward_input_add: a MoE block's shared
// experts beside its router, MLA's two row ranges of kv_a).
void fp8_linear_backward_input_add(const Tensor& dx, const Tensor& dy, const Tensor& w, const Fp8Linear& fp8,
                                   const Fp8GatheredWeight* gathered = nullptr);
// Both backward GEMMs of one layer: fp8_linear_backward_input then
// fp8_linear_backward_weight, bitwise, with dy quantized once. Without fp8.weight_gradient
// (NOTE [FP8 weight gradient switch]) fp8_linear_backward_weight runs in the compute dtype.
void fp8_linear_backward(const Tensor& dx, const Tensor& grad, const Tensor& dy, const Tensor& w, const Tensor& x,
                         const Fp8Linear& fp8, bool overwrite, const Fp8GatheredWeight* gathered = nullptr);
// On CUDA any number of tokens (NOTE [FP8 padded token contraction]).
void fp8_linear_backward_weight(const Tensor& grad, const Tensor& dy, const Tensor& x, const Fp8Linear& fp8,
                                bool overwrite);

}  // namespace forge
