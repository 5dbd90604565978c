// Mixture-of-Experts routing and token movement: the ops a MoE feed-forward component
// (issue 20) composes around its experts, which are SwiGLU feed-forwards run through the
// linear ops on each expert's rows.
//
// NOTE [MoE routing]
// A MoE feed-forward sends each token to k of its E experts and adds their outputs,
// weighted. As Mixtral (transformers' MixtralSparseMoeBlock) does it:
//   logits = x W_router^T                      [tokens, E]   (a linear op)
//   probs = softmax(logits)                    per token, in fp32
//   expert_ids, weights = top-k of probs       descending; ties go to the lower expert id
//   weights /= sum(weights)                    with `normalize` (Mixtral's; Qwen2-MoE's and
//                                              DeepSeek-V2's norm_topk_prob may turn it off)
//   out[t] = x[t] + sum_j weights[t, j] * expert_{expert_ids[t, j]}(x[t])
// The experts do not run per token: the tokens*k assignments (token t's j-th choice is
// assignment t*k + j) are sorted by expert, stably (moe_route), the tokens are copied into
// that order (moe_permute), each expert runs its GEMMs on its own contiguous rows
// [offsets[e], offsets[e + 1]) (no rows: nothing to run; dropless unless a capacity is given:
// NOTE [MoE capacity]), and
// moe_combine adds each assignment's output, weighted, back to its token. The backward
// runs the same steps in reverse: moe_combine_backward gives each permuted row's gradient
// (its weight times the token's) and each weight's (the dot product of the token's gradient
// with that row's expert output), moe_permute_backward sums a token's k row gradients, and
// moe_route_backward carries the weights' gradient through the normalization and the softmax
// to the logits. The top-k choice itself has no gradient, as in every MoE.
// Load balancing (Switch Transformer's auxiliary loss, transformers' load_balancing_loss_func
// for Mixtral): over the routings of all a model's MoE layers, N rows in all (layers x tokens),
//   L_aux = E * sum_e f_e * P_e,   f_e = (assignments to e) / N,  P_e = (sum of probs[., e]) / N
// (f sums to k: transformers counts the k choices the same way; one layer is the per-layer
// form). Its gradient reaches the logits through P only (f counts choices): every
// probability of expert e gets E f_e / N, which moe_route_backward adds when given it.
// Megatron-Core's forms (moe_grouped_balancing_loss): per layer, its aux_loss,
//   L = (E / k) sum_e f_e P_e   over one layer's N tokens (f_e = assignments / N sums to k),
// and per sequence, its seq_aux_loss (DeepSeek-V2/V3's sequence-wise balance loss): the same
// over each sequence's S tokens, averaged over the B sequences,
//   L = (1 / B) sum_b (E / k) sum_e f_be P_be,
// whose probability gradient is a row per sequence: E f_be / (k S B) for each probability of
// expert e in sequence b (per layer: B = 1, S = N). Megatron's global_aux_loss
// (moe_switch_balancing_loss, its switch_load_balancing_loss_func with counts given) takes
// the counts from more tokens than the routing's own: with c_e the tokens per expert
// counted over T tokens (summed over the data-parallel ranks, averaged over an optimizer
// step's micro-batches so far: MoeStepCounts; NOTE [MoE balancing loss] in
// model/moe_feed_forward.h) and P_e the sum of the routing's own probabilities of e,
//   L = E / (k T^2) sum_e c_e P_e,
// whose gradient with respect to each probability of expert e is E c_e / (k T^2); the
// counts take none (with the routing's own counts and T = N it is the per-layer form). The
// router z-loss (ST-MoE's, Megatron's
// z_loss_func): z = mean over tokens of logsumexp(logits_t)^2, its gradient with respect to
// logits_t 2 lse_t softmax(logits_t) / N; the softmax routing keeps each token's logsumexp
// (MoeRouting::lse, from the max and sum its softmax computes) and moe_route_backward adds
// that gradient, scaled, given z_scale. Megatron takes the z-loss of the logits whatever the
// score function; sigmoid routing asked for it (MoeRoutingBuffers::lse and ::softmax) keeps
// the logits' logsumexp and softmax beside its scores, in the same pass.
// DeepSeek-V2 (moe_route_softmax, transformers' DeepseekV2TopkRouter) keeps the softmax and
// may limit the choice to groups (group_limited_greedy: the experts form equal groups, each
// ranked by its largest probability, and only the best `topk_groups` take part) and scale
// the chosen probabilities (routed_scaling_factor; V2 does not renormalize them); the
// backward carries the scaling, the group limit has no gradient.
// DeepSeek-V3 routes differently (moe_route_sigmoid, transformers' DeepseekV3TopkRouter):
// sigmoid scores instead of a softmax, the choice made on scores + a per-expert bias (the
// auxiliary-loss-free balancing's correction, which never reaches the weights),
// group-limited (only the best `topk_groups` of `groups` expert groups, ranked by the sum of
// their two best choice values, take part), the chosen scores renormalized (norm_topk_prob)
// and multiplied by routed_scaling_factor. Its backward runs through the scaling, the
// normalization and the sigmoid; the Switch balancing loss is for softmax routing only.
// On the CPU everything is fp32 with int32 indices (kernels/cpu/moe.h). On CUDA
// (kernels/cuda/moe.h) the routing is fp32 with int32 indices too, token rows are bf16, and
// the routing is written into buffers the caller laid out (MoeRoutingBuffers), since a
// device allocation per call would synchronize; the one host synchronization per routing
// is the copy of the experts' row offsets, which the per-expert GEMMs need on the host
// (none with padding to capacity: NOTE [MoE capacity]).
//
// NOTE [MoE capacity]
// Token dropping, as Megatron-Core 0.16's apply_router_token_dropping (its
// moe_expert_capacity_factor, moe_token_drop_policy, moe_pad_expert_input_to_capacity). With
// a capacity factor f > 0 (MoeCapacity) each expert takes at most
//   C = ceil((tokens * k / experts) * f)          (Megatron's get_capacity, no minimum)
// of a routing's assignments: with policy "probs" the C with the largest routing weights
// (the weights after normalization and scaling, Megatron's routing_probs; ties to the lower
// assignment, i.e. the earlier token: torch.topk leaves ties unspecified), with "position"
// the first C in token order. The rest are dropped: row_of is -1, they contribute nothing
// to the output, and their weights' gradient is zero (moe_combine_backward writes 0), which
// the routing's backward carries through the normalization as Megatron's mask does; the kept
// weights are not renormalized. `weights` keeps the router's values; a drop is only row_of.
// The kept rows stay in assignment order within each expert, so the permuted layout is the
// dropless one with the dropped rows taken out: offsets count the kept rows. The balancing
// losses count the router's assignments before the drop (moe_expert_counts' `assigned`), as
// Megatron's aux losses take their routing map from a fresh top-k
// (compute_routing_scores_for_aux_loss), and the z-loss reads the logits: neither changes.
// With `pad` every expert gets exactly C rows, [e C, (e + 1) C): its kept rows, then zero
// rows (source -1), which the experts turn into zero outputs that nothing reads, and whose
// gradients moe_combine_backward writes as zeros, so they add nothing to the weights'
// gradients. Megatron pads with other tokens at zero probability instead; the outputs and
// gradients are the same. The offsets are then known on the host, e C, and on CUDA the
// routing skips the copy of the offsets: routing and expert GEMMs run without a host
// synchronization. The counts (moe_expert_counts, for the loads the trainer logs and the
// balancing loss) are then read from the device when asked, after the layer's work is queued.
// Megatron refuses padding when C exceeds the tokens (its permute needs C tokens per expert);
// here an expert then simply has more padding. On CUDA the drop ranks an over-full expert's
// assignments by comparing each with all of the expert's others (kernels/cuda/moe_routing.cu).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace forge {

// Expert e's matrix ([2F, H] gate/up or [H, F] down, or a gradient's) of a stacked
// [E, ., .] tensor, as a view.
inline Tensor moe_expert_matrix(const Tensor& stacked, int64_t e) {
  return stacked.narrow(e, e + 1).view({stacked.dim(1), stacked.dim(2)});
}

// Token dropping's settings (NOTE [MoE capacity]): factor 0 is dropless.
struct MoeCapacity {
  double factor = 0.0;
  bool by_position = false;  // policy "position"; "probs" otherwise
  bool pad = false;          // every expert exactly `capacity` rows
  // Each expert's capacity for a routing of `tokens` tokens (Megatron's get_capacity of
  // tokens * k assignments); 0 when dropless.
  int64_t capacity(int64_t tokens, int64_t k, int64_t experts) const;
  // The rows of the permuted buffers: experts x capacity with padding, else tokens x k.
  int64_t permuted_rows(int64_t tokens, int64_t k, int64_t experts) const;
};

struct MoeRouting {
  int64_t tokens = 0, experts = 0, k = 0;
  bool dropping = false;         // NOTE [MoE capacity]: a capacity factor was given
  int64_t capacity = 0;          // each expert's capacity when dropping
  bool pad = false;              // when dropping: every expert `capacity` rows
  bool normalize = true;
  bool sigmoid = false;          // DeepSeek-V3's scores (moe_route_sigmoid) instead of a softmax
  float scaling = 1.0f;          // routed_scaling_factor
  Tensor probs;                  // F32 [tokens, experts]: the softmax's probabilities or the sigmoid's scores
  Tensor lse;                    // F32 [tokens]: the logsumexp of each row of logits, the z-loss's (undefined
                                 // when the buffers have none)
  Tensor softmax;                // F32 [tokens, experts]: sigmoid routing's softmax of the logits, kept with
                                 // lse for the z-loss's gradient (undefined otherwise)
  Tensor expert_ids;             // I32 [tokens, k]
  Tensor weights;                // F32 [tokens, k]
  std::vector<int64_t> offsets;  // experts + 1: expert e's permuted rows [offsets[e], offsets[e + 1])
  // With a capacity, where the host knows them (not on CUDA with padding): experts + 1
  // running sums of each expert's assignments before the drop and of those kept.
  std::vector<int64_t> assigned_offsets, kept_offsets;
  Tensor source;                 // I32 [permuted_rows()]: the assignment at each permuted row, -1 at none
  Tensor row_of;                 // I32 [tokens * k]: the permuted row of each assignment, -1 when dropped
  Tensor sorted;                 // CUDA with a capacity: I32 [tokens * k], the sort's order before the drop
  Tensor device_offsets;         // CUDA only: I64 [experts + 1], offsets on the device; with a capacity
                                 // [2, experts + 1], the kept and the assigned running sums
  Tensor prob_sums;              // CUDA only: F32 [experts], moe_balancing_loss's per-expert sums of probs
  int64_t rows(int64_t expert) const { return offsets.at(static_cast<size_t>(expert) + 1) - offsets.at(static_cast<size_t>(expert)); }
  int64_t permuted_rows() const { return pad ? experts * capacity : tokens * k; }
};

// Per expert, the router's assignments before any drop and those kept (without padding);
// dropless both are the rows. On CUDA with padding read from the device (it waits for the
// routing).
struct MoeCounts {
  std::vector<int64_t> assigned, kept;
};
MoeCounts moe_expert_counts(const MoeRouting& routing);

// Where a routing of `tokens` tokens over `experts` experts with top-k is written: required
// on CUDA (laid out once, e.g. in a model's arena), optional on the CPU (undefined: each
// routing allocates its own).
struct MoeRoutingBuffers {
  Tensor probs;           // F32 [tokens, experts]
  Tensor expert_ids;      // I32 [tokens, k]
  Tensor weights;         // F32 [tokens, k]
  Tensor source;          // I32 [permuted rows] (MoeCapacity::permuted_rows)
  Tensor row_of;          // I32 [tokens * k]
  Tensor offsets;         // CUDA: I64 [experts + 1]; with a capacity [2, experts + 1]
  Tensor prob_sums;       // CUDA: F32 [experts], the balancing loss's scratch
  Tensor lse;             // F32 [tokens], optional: the logits' logsumexp (the z-loss's)
  Tensor sorted;          // CUDA with a capacity: I32 [tokens * k], the sort's order before the drop
  Tensor softmax;         // F32 [tokens, experts], optional: sigmoid routing's softmax of the logits, with lse
  bool defined() const { return probs.defined(); }
};

// Routes each row of logits [tokens, experts] to its top k experts (NOTE [MoE routing]),
// dropping what exceeds each expert's capacity when one is given (NOTE [MoE capacity]).
MoeRouting moe_route(const Tensor& logits, int64_t k, bool normalize, const MoeRoutingBuffers& buffers = {},
                     const MoeCapacity& capacity = {});

// The same with DeepSeek-V2's options (NOTE [MoE routing]): with topk_groups < groups only the
// experts of the topk_groups groups with the largest best probability take part
// (group_limited_greedy), and the chosen weights are multiplied by `scaling`
// (routed_scaling_factor). moe_route is groups 1 and scaling 1.
MoeRouting moe_route_softmax(const Tensor& logits, int64_t k, int64_t groups, int64_t topk_groups, bool normalize,
                             float scaling, const MoeRoutingBuffers& buffers = {}, const MoeCapacity& capacity = {});

// DeepSeek-V3's routing (NOTE [MoE routing]); bias [experts] (fp32) may be undefined (zero).
MoeRouting moe_route_sigmoid(const Tensor& logits, const Tensor& bias, int64_t k, int64_t groups, int64_t topk_groups,
                             bool normalize, float scaling, const MoeRoutingBuffers& buffers = {},
                             const MoeCapacity& capacity = {});

// d_logits [tokens, experts] (written over) from d_weights [tokens, k]. Softmax routing
// only: with prob_gradient (F32 [experts], or [groups, experts] with groups dividing the
// tokens, on the routing's device) that gradient with respect to each probability of each
// expert is added, row g for the tokens of group g (tokens / groups consecutive tokens; a
// balancing loss's: MoeBalance::prob_gradient times its coefficient); with z_scale != 0,
// z_scale x lse_t x softmax(logits_t) is added to each token's logits gradient (the
// z-loss's: z_scale = 2 coefficient / tokens; the routing must have kept lse, and with
// sigmoid routing the softmax).
void moe_route_backward(const Tensor& d_logits, const Tensor& d_weights, const MoeRouting& routing,
                        const Tensor* prob_gradient = nullptr, double z_scale = 0.0);

// A balancing loss over softmax routings (NOTE [MoE routing]), in double, and its gradient
// with respect to each probability: [experts] (the same for every token) or [groups,
// experts] (a row per group of tokens).
struct MoeBalance {
  double loss = 0.0;
  std::vector<double> prob_gradient;
};
// transformers' Mixtral form, pooled over the routings (every layer's): prob_gradient
// [experts], E f_e / N.
MoeBalance moe_balancing_loss(const std::vector<const MoeRouting*>& routings);
// The same in two halves, for routings that several pipeline stages hold (NOTE [Pooled
// balancing loss across stages] in model/moe_feed_forward.h): the pooled form's statistics,
// [2 experts + 1] doubles (each expert's assignments before any drop, then each expert's
// probability sum, then the rows), to which moe_add_balancing_statistics adds one routing,
// and the loss and gradient from them. Adding the routings in order from zeros and taking
// the loss gives moe_balancing_loss's values bit for bit (it is made of the two).
std::vector<double> moe_balancing_statistics_zero(int64_t experts);
void moe_add_balancing_statistics(std::vector<double>& statistics, const MoeRouting& routing);
MoeBalance moe_statistics_balancing_loss(const std::vector<double>& statistics);
// Megatron's, over one routing whose tokens form `groups` equal groups of consecutive tokens
// (1: its aux_loss; the micro-batch's sequences: its seq_aux_loss): (1 / groups) sum_g (E / k)
// sum_e f_ge P_ge; prob_gradient [groups, experts], E f_ge / (k S groups), S = tokens / groups.
MoeBalance moe_grouped_balancing_loss(const MoeRouting& routing, int64_t groups);
// Megatron's Switch loss of one routing's probabilities with counts from elsewhere (its
// switch_load_balancing_loss_func; the global form, NOTE [MoE routing]): tokens_per_expert
// [experts] counted over total_tokens tokens (at least the routing's), E / (k T^2) sum_e
// c_e P_e; prob_gradient [experts], E c_e / (k T^2).
MoeBalance moe_switch_balancing_loss(const MoeRouting& routing, const std::vector<double>& tokens_per_expert,
                                     double total_tokens);
// The global form's counts over an optimizer step (Megatron's global_tokens_per_expert and
// ga_steps): each micro-batch's counts (already summed over the data-parallel ranks) added
// to the step's, and their average over the step's micro-batches so far returned.
class MoeStepCounts {
 public:
  // A new optimizer step: nothing counted (Megatron's reset_global_aux_loss_tracker).
  void reset();
  // Adds a micro-batch's counts (as many every time within a step); returns the step's sums
  // over its micro-batches so far divided by their number, this one included.
  std::vector<double> add(const std::vector<int64_t>& counts);
  int64_t micro_batches() const { return micro_batches_; }

 private:
  std::vector<double> sums_;
  int64_t micro_batches_ = 0;
};
// The router z-loss of one softmax routing, in double: the mean over its tokens of lse^2
// (without the coefficient; 0 without tokens).
double moe_z_loss(const MoeRouting& routing);

// Auxiliary-loss-free balancing's step (NOTE [Routing bias update] in train/trainer.cpp):
// bias (F32, CPU) += rate x sign(mean load - load_e) for each expert e it holds: the biases
// of experts [first_expert, first_expert + bias.numel()) of the block's load.size() (a
// rank's FSDP chunk of them, or all of them), the mean taken over every expert's load.
void moe_update_routing_bias(const Tensor& bias, const std::vector<int64_t>& load, double rate,
                             int64_t first_expert = 0);

// permuted [permuted rows, hidden]: row r is x's row of the token whose assignment it holds,
// for the rows below offsets.back(); a padding row is zero (NOTE [MoE capacity]).
void moe_permute(const Tensor& permuted, const Tensor& x, const MoeRouting& routing);
// dx [tokens, hidden] (written over) = the sum of each token's kept rows of d_permuted.
void moe_permute_backward(const Tensor& dx, const Tensor& d_permuted, const MoeRouting& routing);

// out [tokens, hidden] = residual (when given; may be out itself) + sum over each token's
// kept assignments of weight x expert_out's row.
void moe_combine(const Tensor& out, const Tensor& expert_out, const MoeRouting& routing, const Tensor* residual);
// d_expert_out [permuted rows, hidden] (written over): each kept row's weight times its
// token's dout row, padding rows zero (rows of no assignment otherwise untouched);
// d_weights [tokens, k] (written over): dout[t] . expert_out[row of (t, j)], 0 when dropped.
void moe_combine_backward(const Tensor& d_expert_out, const Tensor& d_weights, const Tensor& dout,
                          const Tensor& expert_out, const MoeRouting& routing);

// The routed experts, each a SwiGLU feed-forward (gate_up [2F, H] with the gate rows first,
// then down [H, F], transformers' MixtralExperts layout), run on their own rows of the
// permuted buffers: one gate/up GEMM, SwiGLU and one down GEMM per expert with rows, through
// the linear and SwiGLU ops. Buffers are [permuted rows, ...] in permuted order. Only the
// routing's `experts` and `offsets` are read (within the buffers' rows), so a routing that
// holds just those serves too: expert parallelism's received rows (NOTE [Expert
// parallelism] in model/expert_dispatch.h), whose buffers are narrowed to what arrived.
struct LoraExpertAdapter;  // ops/lora_experts.h
struct MoeExpertWeights {
  Tensor gate_up;  // [experts, 2 * ffn, hidden]
  Tensor down;     // [experts, hidden, ffn]
  // LoRA on the routed experts (NOTE [LoRA on routed experts] in ops/lora_experts.h): each
  // stack's adapters, null without; in a gradient descriptor the same adapters, whose
  // gradient buffers receive the adapters' gradients.
  const LoraExpertAdapter* gate_up_lora = nullptr;
  const LoraExpertAdapter* down_lora = nullptr;
};
struct MoeExpertBuffers {
  Tensor permuted;    // [rows, hidden]: the input, from moe_permute
  Tensor gate_up;     // [rows, 2 * ffn]
  Tensor swiglu;      // [rows, ffn]
  Tensor expert_out;  // [rows, hidden]: the output, for moe_combine
};
void moe_experts_forward(const MoeExpertBuffers& a, const MoeExpertWeights& w, const MoeRouting& routing);

// NOTE [MoE expert GEMMs]
// The experts' GEMMs run one per expert with rows, on the expert's block of rows (on CUDA
// one cuBLASLt GEMM each; SwiGLU runs once over all rows), with the sizes from the
// routing's host offsets. Not grouped, measured on the H100 (docs/PERF.md,
// "Mixture-of-Experts"): cuBLAS 13.0's cublasGemmGroupedBatchedEx takes bf16 operands only
// with a bf16 output (no fp32 weight gradients), and returned CUBLAS_STATUS_NOT_SUPPORTED
// for the bf16 forward there; cuBLASLt's grouped GEMM (CUDA 13.1) and cuDNN's MoE grouped
// matmul (9.15, its backward 9.22) are newer than the device's CUDA 13.0 and cuDNN 9.14.
// An expert's row count changes every step, so its GEMMs are matmul_varying's, whose
// cuBLASLt plans serve every size of a bucket (NOTE [GEMMs of varying size]) rather than
// one plan, made on first sight, per size. When every expert has the same rows (padding to
// capacity, NOTE [MoE capacity]; under expert parallelism each local expert then receives
// the same rows from every rank) the experts' GEMMs are one batched GEMM each, every
// expert's matrices one stride apart (matmul_batched, NOTE [Batched GEMMs] in
// kernels/cuda/matmul.cpp): one launch per GEMM kind instead of one per expert, and no row
// count read from the device.

// d_permuted [rows, hidden] (written over) from d_expert_out; the weights' gradients into
// `grads` (fp32, written over when `overwrite`, else added; an expert with no rows adds
// nothing), none when both of its tensors are undefined (frozen experts). d_swiglu [rows,
// ffn] and d_gate_up [rows, 2 * ffn] are scratch.
void moe_experts_backward(const Tensor& d_permuted, const MoeExpertWeights& grads, bool overwrite,
                          const Tensor& d_expert_out, const MoeExpertBuffers& a, const MoeExpertWeights& w,
                          const MoeRouting& routing, const Tensor& d_swiglu, const Tensor& d_gate_up);

}  // namespace forge
