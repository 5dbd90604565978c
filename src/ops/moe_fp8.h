// The routed experts' GEMMs in FP8 (precision.fp8 on a Mixture-of-Experts model, issue 20).
//
// NOTE [FP8 routed experts]
// moe_experts_forward / moe_experts_backward (ops/moe.h) run each expert's gate/up and down
// GEMMs on its own rows of the permuted buffers; with precision.fp8 these run them as the
// dense FP8 linear does (NOTE [FP8 tensorwise linear], NOTE [FP8 delayed scaling] in
// ops/fp8_linear.h), expert by expert, as Transformer Engine's per-expert GEMMs: for each
// expert e with rows, and each of its two matrices,
//   forward         y_e  = x_e W_e^T     x_e E4M3, W_e E4M3
//   input gradient  dx_e = dy_e W_e      dy_e in the grad format (E5M2 unless precision.fp8_grad_format e4m3)
//   weight gradient dW_e = dy_e^T x_e    written over or added to
// each through fp8_linear_forward and fp8_linear_backward (both backward GEMMs in one call,
// dy_e cast once into its codes and their transpose) on the expert's slice of the weight
// stack and its block of rows (under FSDP's FP8 all-gather the stack's E4M3 codes, expert
// e's with its own gathered scale: NOTE [FP8 all-gather pieces] in
// distributed/fsdp_fp8_pieces.h). Every expert's matrix has
// its own statistics block (NOTE [FP8 projection statistics] in kernels/cpu/fp8_scaling.h;
// Fp8Projections numbers E of them per stack, in expert order), so each expert quantizes
// its weight with its own scale, and its rows' activations and gradients with scales of
// their own: with `tensorwise` the amax of the expert's own rows, with `delayed` the
// expert's own histories (updated at the step's end with every other block's, max-reduced
// over the data-parallel ranks with them and saved in checkpoints). An expert that receives
// no rows runs nothing and folds no amax that step: under `delayed` its histories take a
// zero, which Transformer Engine's update passes over (the scale stays), as for a projection
// that saw nothing. SwiGLU runs once over all rows in the compute dtype, as without FP8.
// On CUDA an expert's row count is anything the routing gives; the weight gradient pads it
// to a multiple of 16 with zero tokens (NOTE [FP8 padded token contraction] in
// ops/fp8_linear.h), which changes no amax and adds nothing to the gradient. On CUDA each
// local expert has the forward statistics and weight cache a dense projection has (NOTE
// [FP8 expert stack state]), and the forward quantizes all experts' rows at once (NOTE [FP8
// grouped expert casts] in kernels/cuda/fp8_grouped_cast.cu), bitwise as expert by expert;
// the stack's own forward statistics, weight cache and fused producers are not used. The
// GEMMs keep their plans per bucket of row counts (NOTE [FP8 GEMMs of varying size] in
// kernels/cuda/fp8_matmul.cpp). Not yet done for speed: the experts' GEMMs are never
// batched, even when padded to capacity, and the backward's casts are expert by expert. The router (a [E, hidden] GEMM whose
// logits choose the experts) stays in the compute dtype, as in Transformer Engine's and
// torchao's MoE recipes; the shared experts and dense blocks are plain projections and run
// in FP8 as any other. precision.fp8_routed_experts false keeps the routed experts out of
// all this (NOTE [FP8 routed experts switch] in model/fp8_projections.h): their stacks carry
// no FP8 settings and run moe_experts_forward / moe_experts_backward's compute-dtype path.
//
// NOTE [FP8 routed experts under expert parallelism]
// With parallelism.expert_parallel_degree P > 1 (NOTE [Expert parallelism] in
// model/expert_dispatch.h) a rank runs its E / P local experts on the rows every rank of its
// group sent them, sorted by local expert (ExpertExchange's plan.local). The FP8 GEMMs take
// those rows expert by expert as above, with the statistics blocks of the model's experts
// they are (MoeExpertFp8::first_expert: the rank's first local expert; the blocks are the
// whole model's, numbered in expert order, on every rank). So a local expert's tensorwise
// scales come from its own slice of the weights and from every row its group sent it (one
// amax over the rows one device would run it on, had it run the group's micro-batches as
// one), and its delayed histories take the amaxes of those rows; the blocks of the experts
// on the other ranks of the group see no cast here, their `seen` stays 0, and the trainer's
// step-end max-reduction of the whole statistics array over the data-parallel ranks (NOTE
// [FP8 under data parallelism] in train/trainer_fp8.cpp; the expert-parallel group is among
// them) fills each from its owner, as over the pipeline (NOTE [FP8 under context and
// pipeline parallelism]): every rank then holds the whole model's delayed state, the same
// everywhere, and rank 0's checkpoint restores under any degree. A local expert may receive
// P times a micro-batch's rows: the CUDA scratch is sized for them (Fp8Settings::
// expert_parallel).
//
// NOTE [FP8 frozen routed experts]
// Under LoRA with precision.fp8 (NOTE [FP8 frozen base] in model/fp8_projections.h) the
// routed experts are part of the frozen base: Fp8Projections hands out their stacks with
// the FP8 settings above and LoraAdapters hands out gradient descriptors with no tensor
// (NOTE [LoRA on MoE and MLA models] in model/lora.h). moe_experts_backward_fp8 then runs
// each expert's input gradient dx_e = dy_e W_e in FP8 and no weight gradient, as the dense
// frozen projections do; the forward is full FP8 training's, expert by expert with each
// expert's own statistics block. Adapters on the stacks (NOTE [LoRA on routed experts] in
// ops/lora_experts.h) add their low-rank share after each frozen FP8 GEMM in the compute
// dtype, reading the unquantized x and dy, exactly as over the bf16 experts: u_e = x_e A_e^T,
// y_e += scale u_e B_e^T; dx_e += scale (dy_e B_e) A_e; dA_e, dB_e from dy_e and x_e. So an
// adapter's gradient differs from the bf16 run's only through the FP8 rounding of the
// frozen GEMMs upstream and downstream of it (its dy is the FP8 input gradient of what
// follows). The per-expert state (NOTE [FP8 expert stack state]) is made as in full
// training. With `tensorwise` a frozen expert's weight cache is filled once for the run (the
// clock does not move), as a dense frozen projection's, the scale travelling with the codes
// in its forward statistics. With `delayed` it is used once the delayed scales are, and cast
// again after every update (Fp8Projections' expert clock moves with each delayed end_step):
// a dense frozen W is cast in the first step, so its delayed scale is constant from the
// first update on, but an expert may receive no rows before some later step, and its W scale
// then changes at the update that follows; codes cast with the old scale must not be read
// with the new one. So a delayed run casts each local expert's W once per step, as full
// training does. Under expert parallelism a rank's local experts and their adapters' slices
// (NOTE [LoRA under expert parallelism] in model/lora.h) run on the received rows as above.
#pragma once

#include <vector>

#include "kernels/cuda/fp8_grouped_layout.h"
#include "ops/fp8_linear.h"
#include "ops/moe.h"

namespace forge {

// NOTE [FP8 expert stack state]
// What the dense projections keep per projection, the experts keep per local expert, in an
// Fp8ExpertStack the stack's Fp8Linear points at (Fp8Linear::experts; Fp8Projections makes
// one per expert-stack parameter of a layer the first time the layer is handed out, sized
// by the stack it holds: E / P local experts under expert parallelism) and
// fp8_expert_linear hands to expert e's settings:
//  - its forward statistics (NOTE [FP8 forward statistics] in ops/fp8_linear.h): the
//    backward reuses the x and W scales of the expert's forward, so its input gradient
//    casts W^T with the forward's scale (no amax pass) and its weight gradient skips x's
//    amax pass; the slots of all local experts are one device array, expert e's at
//    e x kFp8WorkspaceStats floats, which the grouped casts write with a stride;
//  - its weight cache (NOTE [FP8 weight cache]), with precision.fp8_weight_cache on CUDA:
//    W and W^T cast once per optimizer step and reused by every micro-batch (and by
//    activation checkpointing's recomputed forward), keyed as any cache entry by the
//    expert's matrix (its address in the stack and its size), so FSDP's gathered stacks
//    under ZeRO-3 are cast again only when they move; 2 bytes per local expert weight,
//    counted by fp8_weight_cache_bytes. The scales travel with the codes as for a dense
//    projection (tensorwise in the forward statistics, delayed in the expert's block), and
//    the codes are the bytes the uncached path casts, so results are bitwise the same. An
//    expert that receives no rows in the step's first micro-batch is cast by the first one
//    that gives it rows: each expert's W amax is folded into its `seen` exactly when the
//    uncached path would first fold it, so the delayed histories are unchanged;
//  - its Fp8Produced record: the grouped casts of its rows (NOTE [FP8 grouped expert casts]
//    in kernels/cuda/fp8_grouped_cast.cu) hand its forward x's codes (and under
//    `tensorwise` its scales) as a fused producer does (NOTE [FP8 fused producers]), and in
//    the backward, under `tensorwise`, its output gradient's amax and scales.
// The stack's own Fp8Linear keeps no forward statistics, weight cache or producer record
// (fp8_expert_linear clears them): its experts' rows and matrices are never one tensor.
// On the CPU nothing of this exists (the reference quantizes every operand each time).
struct Fp8ExpertStack {
  Tensor forward_stats;                    // CUDA: F32 [local experts x kFp8WorkspaceStats]
  std::vector<Fp8ForwardStats> forward;    // one per local expert, pointing into forward_stats
  std::vector<Fp8WeightCache> caches;      // one per local expert; empty without the cache
  bool cache_in_use = true;                // false while NOTE [FP8 frozen base] keeps caches off
  std::vector<Fp8Produced> produced;       // one per local expert
  // NOTE [FP8 grouped expert casts]: every local expert's rows quantized in a few launches
  // into `row_codes` (U8, shared by every stack of the model; each expert's codes from a
  // 256-byte boundary, fp8_grouped_codes_at), the routing's offsets uploaded to `offsets`
  // (I64, experts + 1, this stack's). Only for widths that are multiples of 16.
  // Off (expert by expert, the same bits) without them, or with `grouped` false.
  // The backward's output gradients too, under `tensorwise`: each expert's amax, scale
  // and inverse scale of dy in two launches into `backward_stats` (F32 [local experts x 3 x
  // kFp8StatStride]), handed on through its Fp8Produced (dy_stats_at).
  bool grouped = true;
  Tensor* row_codes = nullptr;
  Tensor offsets;
  Tensor backward_stats;
  int64_t experts() const { return static_cast<int64_t>(forward.size()); }
};

// Allocates the per-expert state of a stack [experts, out, in] on `device` (CUDA: the
// forward statistics; the weight cache with `weight_cache`, ticking with `generation`).
void init_fp8_expert_stack(Fp8ExpertStack& stack, int64_t experts, int64_t out, int64_t in, Device device,
                           bool weight_cache, const uint64_t* generation, Tensor* row_codes);

// The FP8 settings of a block's expert stacks (Fp8Projections' descriptors of the 3-D
// gate/up and down parameters): each points at the stack's first expert's statistics block,
// the others following it.
struct MoeExpertFp8 {
  const Fp8Linear* gate_up = nullptr;
  const Fp8Linear* down = nullptr;
  // The stack's expert whose statistics block the weights' first expert takes (NOTE [FP8
  // routed experts under expert parallelism]: the rank's first local expert); 0: all of them.
  int64_t first_expert = 0;
  // FSDP's FP8 all-gather (NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h):
  // the stacks are E4M3 codes, expert e's cast as Fp8GatheredWeight [e] says; null: bf16.
  const Fp8GatheredWeight* gate_up_gathered = nullptr;
  const Fp8GatheredWeight* down_gathered = nullptr;
  bool enabled() const { return gate_up && down; }
};

// Expert e's settings: the stack's, with its own statistics block (the model's expert
// `expert`); with the stack's per-expert state (NOTE [FP8 expert stack state]) that of its
// local expert `local` (its forward statistics, weight cache and producer record), without
// (local -1, or no state) none of the per-call records.
Fp8Linear fp8_expert_linear(const Fp8Linear& stack, int64_t expert, int64_t local = -1);

// moe_experts_forward in FP8 (NOTE [FP8 routed experts]).
void moe_experts_forward_fp8(const MoeExpertBuffers& a, const MoeExpertWeights& w, const MoeRouting& routing,
                             const MoeExpertFp8& fp8);

// moe_experts_backward in FP8; the experts are trained (the gradients defined).
void moe_experts_backward_fp8(const Tensor& d_permuted, const MoeExpertWeights& grads, bool overwrite,
                              const Tensor& d_expert_out, const MoeExpertBuffers& a, const MoeExpertWeights& w,
                              const MoeRouting& routing, const Tensor& d_swiglu, const Tensor& d_gate_up,
                              const MoeExpertFp8& fp8);

}  // namespace forge
