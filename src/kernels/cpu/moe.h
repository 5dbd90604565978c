// Mixture-of-Experts routing and token movement on the CPU: the reference the CUDA kernels
// of issue 20 will be checked against. Everything is fp32 values with int32 indices, one
// token per row. NOTE [MoE routing] in ops/moe.h says what each step computes and why.
#pragma once

#include <bit>
#include <cstdint>

namespace forge::cpu {

// probs [tokens, experts] = softmax of each row of logits; then each token's k largest
// probabilities (ties: the lower expert id) into expert_ids / weights [tokens, k], in
// descending order; with `normalize` the k weights are divided by their sum (Mixtral); the
// weights times `scaling` (DeepSeek-V2's routed_scaling_factor). With topk_groups < groups
// (DeepSeek-V2's group_limited_greedy) the experts form `groups` equal groups, each ranked
// by its largest probability, and only the `topk_groups` best groups (ties: the lower
// group) take part in the top-k. lse [tokens], when not null: each row's logsumexp (max +
// log of the sum of exp(l - max); the router z-loss's).
void moe_topk_softmax(const float* logits, int64_t tokens, int64_t experts, int64_t k, bool normalize, float* probs,
                      int32_t* expert_ids, float* weights, float* lse = nullptr, int64_t groups = 1,
                      int64_t topk_groups = 1, float scaling = 1.0f);

// d_logits [tokens, experts] (written over) from d_weights [tokens, k], through the
// scaling, the normalization and the softmax (the group limit has no gradient). prob_gradient, when not null, [tokens / group_tokens,
// experts], is a gradient with respect to the probabilities added before the softmax's
// backward, row g for the tokens [g group_tokens, (g + 1) group_tokens) (a balancing loss's:
// one row for a layer's tokens, or one per sequence). With lse (the forward's) and
// z_scale, z_scale x lse[t] x probs[t] is added to d_logits (the z-loss's gradient,
// z_scale = 2 coefficient / tokens).
void moe_topk_softmax_backward(const float* d_weights, const float* prob_gradient, int64_t group_tokens,
                               const float* probs, const int32_t* expert_ids, const float* weights, int64_t tokens,
                               int64_t experts, int64_t k, bool normalize, float* d_logits,
                               const float* lse = nullptr, double z_scale = 0.0, float scaling = 1.0f);

// DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): scores [tokens, experts] =
// sigmoid(logits); the choice ranks scores + bias (bias [experts], auxiliary-loss-free
// balancing's correction; null: zero); the experts form `groups` equal groups, each group
// ranked by the sum of its two best choice values, and only the `topk_groups` best groups
// take part (group-limited routing; groups 1: all); then the k best choice values among
// those (ties: the lower id). weights = the chosen scores (without the bias), divided by
// their sum + 1e-20 with `normalize`, times `scaling` (routed_scaling_factor). With lse
// [tokens] and softmax [tokens, experts] (both or neither), each row's logsumexp and the
// softmax of its logits too: the router z-loss's, which Megatron takes of the logits
// whatever the score function.
void moe_topk_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t experts, int64_t k,
                      int64_t groups, int64_t topk_groups, bool normalize, float scaling, float* scores,
                      int32_t* expert_ids, float* weights, float* lse = nullptr, float* softmax = nullptr);

// d_logits [tokens, experts] (written over) from d_weights [tokens, k], through the
// normalization, the scaling and the sigmoid (the bias and the choice have no gradient).
// With lse and softmax (the forward's), z_scale x lse[t] x softmax[t] is added (the z-loss's
// gradient, z_scale = 2 coefficient / tokens).
void moe_topk_sigmoid_backward(const float* d_weights, const float* scores, const int32_t* expert_ids,
                               int64_t tokens, int64_t experts, int64_t k, bool normalize, float scaling,
                               float* d_logits, const float* lse = nullptr, const float* softmax = nullptr,
                               double z_scale = 0.0);

// The tokens*k assignments (token t's j-th expert is assignment t*k + j) sorted by expert,
// stable in assignment order: offsets [experts + 1] (expert e owns permuted rows
// [offsets[e], offsets[e + 1])), source [tokens*k] (the assignment at each permuted row) and
// row_of [tokens*k] (the permuted row of each assignment).
void moe_sort_by_expert(const int32_t* expert_ids, int64_t tokens, int64_t k, int64_t experts, int64_t* offsets,
                        int32_t* source, int32_t* row_of);

// Token dropping (NOTE [MoE capacity] in ops/moe.h), after moe_sort_by_expert: sorted
// [tokens * k] and sorted_offsets [experts + 1] are its source and offsets. Each expert keeps
// at most `capacity` of its assignments: the first in assignment order (`by_position`), or
// those with the largest weights [tokens * k] (compared as ordered keys of their bits, ties to
// the lower assignment), kept in assignment order. kept_offsets [experts + 1]: the running sum
// of the kept counts. source [pad ? experts * capacity : tokens * k]: the assignment at each
// permuted row, expert e's kept rows from kept_offsets[e] (pad: from e * capacity, then its
// padding), -1 at rows without one (padding, and without `pad` the rows past the last kept).
// row_of [tokens * k]: each assignment's permuted row, -1 when dropped.
void moe_drop_to_capacity(const int32_t* sorted, const int64_t* sorted_offsets, const float* weights, int64_t tokens,
                          int64_t k, int64_t experts, int64_t capacity, bool by_position, bool pad,
                          int64_t* kept_offsets, int32_t* source, int32_t* row_of);

// The order moe_drop_to_capacity ranks weights by (larger first): a float's bits mapped to
// an unsigned key that orders every value, NaNs included, so that exactly `capacity`
// assignments are kept whatever the weights.
inline uint32_t moe_weight_key(float w) {
  const uint32_t u = std::bit_cast<uint32_t>(w);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace forge::cpu
