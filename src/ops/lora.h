// LoRA adapters on linear layers (Hu et al. 2021, as Hugging Face PEFT and torchtune run
// them): a frozen weight W plus a trainable low-rank update,
//   y = x W^T + scale * dropout(x) A^T B^T,    A [rank, in], B [out, rank], scale = alpha / rank.
//
// NOTE [LoRA linear]
// forge fuses q, k, v into one projection and gate, up into another (NOTE [Fused
// projections]); PEFT adapts each of q_proj, k_proj, ... separately, each with its own A,
// B and dropout. An adapter on a fused projection holds the adapted modules ("parts") in
// stacking order and behaves exactly as their separate PEFT adapters:
//   a  [parts * rank, in]   the parts' A matrices stacked (part k: rows [k r, (k+1) r));
//   b  [out, parts * rank]  part k's B in its own output rows and columns [k r, (k+1) r),
//                            zero elsewhere, so one GEMM adds every part's update.
// The low-rank activations are kept transposed, u^T = a x^T [parts * rank, tokens], so
// each part's share is a contiguous block of rows:
//   forward          u^T = a x^T (one GEMM for all parts without dropout, one per part with
//                    it, each on its own dropout of x);  y += scale * u b^T (the GEMM's C
//                    operand: beta = 1 into the y the base GEMM wrote, no separate pass)
//   backward input   g^T = b^T dy^T;  dx += scale * g a (per part through its dropout)
//   backward weight  da = scale * g^T x_dropped,  db = scale * dy^T u, then db's entries
//                    outside each part's rows are zeroed (lora_mask_blocks), so b keeps
//                    its zeros under AdamW and the parts stay PEFT's separate adapters.
// The b GEMMs run over all `out` rows for every part: parts × (out × rank) multiply-adds
// per token instead of out × rank, a few percent of the frozen GEMM (rank ≪ in).
// Nothing of the adapter is kept between forward and backward: u and the dropout masks
// are recomputed from x (2 · tokens · in · parts · rank FLOPs), so every activation-
// checkpointing mode works unchanged and the activation memory does not grow.
// Alignment: the holder places a and b 256-byte aligned (model/lora.h); with dropout, a
// part's rows of a and u^T start k · rank · in and k · rank · tokens values in, 16-byte
// aligned in bf16 for ranks that are multiples of 8.
//
// NOTE [LoRA dropout]
// PEFT applies nn.Dropout(p) to the adapter's input, per module. forge draws the mask from
// a counter-based hash of (seed, element index) (kernels/lora_dropout_mask.h), identical
// on the CPU and the GPU; the seed is the adapter holder's, derived from the run's seed,
// the micro-batch's position in the run, the layer and the part, so a recomputation, the
// backward, and a resumed run see the same masks.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace forge {

// Scratch the adapter ops compute in, shared by every adapter of a model (layers run one
// after another): [parts * rank, tokens] twice and [tokens, in] once, each large enough
// for the largest adapter, in the compute dtype.
struct LoraWorkspace {
  Tensor low_rank, low_rank_grad;  // flat, at least max(parts * rank) * tokens values each
  Tensor wide;                     // flat, at least tokens * max(in) values
};

// One adapted module's output rows in the fused projection, in stacking order.
struct LoraPartRows {
  int64_t begin = 0, end = 0;
};

// A layer's adapter as the linear ops read it (NOTE [LoRA linear]). A weight descriptor
// points at it for the forward and the input gradient; a gradient descriptor at the same
// object, whose grad_a / grad_b receive the adapter's gradients.
struct LoraAdapter {
  Tensor a;                 // [parts * rank, in], compute dtype
  Tensor b;                 // [out, parts * rank], compute dtype
  Tensor grad_a, grad_b;    // fp32, shaped as a and b; undefined where no gradient is wanted
  int64_t rank = 0;
  float scale = 1.0f;       // alpha / rank
  float dropout = 0.0f;     // probability in [0, 1)
  uint64_t dropout_seed = 0;  // this micro-batch's; part k uses derive_seed(dropout_seed, k)
  std::vector<LoraPartRows> parts;
  LoraWorkspace* workspace = nullptr;
  // A row view's (lora_rows) whose A gradient another view of the same adapter wrote
  // earlier in the backward: grad_a is added to even when the op is told to overwrite.
  bool accumulate_grad_a = false;

  int64_t low_rank() const { return rank * static_cast<int64_t>(parts.size()); }
};

// NOTE [LoRA row views]
// A layer that runs one projection as GEMMs on ranges of its output rows (MLA's kv_a: its
// compressed rows and its rotary key's, NOTE [Multi-head Latent Attention] in
// model/latent_attention.h) gives each range the adapter restricted to those rows: the same
// A, B's rows (a view: B is [out, parts * rank], row-major), grad_b's alike, and the parts'
// rows clipped to the range and counted from its start. The ranges' forwards and input
// gradients add up to the whole adapter's (each adds its rows' share); their B gradients
// are disjoint rows; A's gradient sums over the ranges, so every view after the first in
// backward order sets accumulate_grad_a. Dropout masks follow the part indices, which the
// views keep.
LoraAdapter lora_rows(const LoraAdapter& lora, int64_t begin, int64_t end, bool accumulate_grad_a);

// The adapter's share of the linear ops (ops/linear.h calls these after the frozen GEMMs).
void lora_forward_add(const Tensor& y, const Tensor& x, const LoraAdapter& lora);
void lora_backward_input_add(const Tensor& dx, const Tensor& dy, const LoraAdapter& lora);
void lora_backward_weight(const LoraAdapter& lora, const Tensor& dy, const Tensor& x, bool overwrite);

// out = (accumulate ? out : 0) + dropout(in): elements kept with probability 1 - p and
// scaled by 1 / (1 - p) (NOTE [LoRA dropout]); out and in alike shaped, compute dtype.
void lora_dropout(const Tensor& out, const Tensor& in, float p, uint64_t seed, bool accumulate);
// Zeroes b's ([out, parts * rank], fp32) entries outside each part's rows.
void lora_mask_blocks(const Tensor& b, int64_t rank, const std::vector<LoraPartRows>& parts);

}  // namespace forge
