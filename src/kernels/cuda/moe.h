// Mixture-of-Experts routing and token movement on the GPU (issue 20): the CUDA side of
// ops/moe.h, each kernel checked against its CPU reference in kernels/cpu/moe.h (NOTE [MoE
// routing] in ops/moe.h says what each step computes). Routing values are fp32 with int32
// indices as on the CPU; token rows are bf16 with fp32 arithmetic. Every pointer is device
// memory; every function launches on the current stream and never synchronizes with the
// host. Results are deterministic: no float atomics, every sum in a fixed order.
#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// The largest expert count the routing kernels take (DeepSeek-V3 has 256).
constexpr int64_t kMoeMaxExperts = 1024;

// As cpu::moe_topk_softmax: probs [tokens, experts] = each row's softmax; each token's k
// largest probabilities (ties: the lower expert id) into expert_ids / weights [tokens, k],
// descending; with `normalize` divided by their sum; times `scaling`; with topk_groups <
// groups only the experts of the topk_groups groups with the largest best probability
// (DeepSeek-V2's group_limited_greedy); lse [tokens] (null: not written) each row's
// logsumexp (fp32: max + logf of the fp32 sum).
void moe_topk_softmax(const float* logits, int64_t tokens, int64_t experts, int64_t k, bool normalize, float* probs,
                      int32_t* expert_ids, float* weights, float* lse = nullptr, int64_t groups = 1,
                      int64_t topk_groups = 1, float scaling = 1.0f);

// As cpu::moe_topk_softmax_backward: prob_gradient [tokens / group_tokens, experts] (null:
// none), row g added for the tokens of group g; with lse, z_scale x lse[t] x probs[t] added
// to d_logits; `scaling` the forward's. d_logits [tokens, experts] is written over.
void moe_topk_softmax_backward(const float* d_weights, const float* prob_gradient, int64_t group_tokens,
                               const float* probs, const int32_t* expert_ids, const float* weights, int64_t tokens,
                               int64_t experts, int64_t k, bool normalize, float* d_logits,
                               const float* lse = nullptr, double z_scale = 0.0, float scaling = 1.0f);

// As cpu::moe_topk_sigmoid (DeepSeek-V3's group-limited sigmoid router; bias may be null;
// lse and softmax, both or neither, the z-loss's: fp32 max + logf of the fp32 sum).
void moe_topk_sigmoid(const float* logits, const float* bias, int64_t tokens, int64_t experts, int64_t k,
                      int64_t groups, int64_t topk_groups, bool normalize, float scaling, float* scores,
                      int32_t* expert_ids, float* weights, float* lse = nullptr, float* softmax = nullptr);

// As cpu::moe_topk_sigmoid_backward.
void moe_topk_sigmoid_backward(const float* d_weights, const float* scores, const int32_t* expert_ids,
                               int64_t tokens, int64_t experts, int64_t k, bool normalize, float scaling,
                               float* d_logits, const float* lse = nullptr, const float* softmax = nullptr,
                               double z_scale = 0.0);

// As cpu::moe_sort_by_expert, stable in assignment order: offsets [experts + 1] (int64),
// source and row_of [tokens * k]. Every expert id must be in [0, experts).
void moe_sort_by_expert(const int32_t* expert_ids, int64_t tokens, int64_t k, int64_t experts, int64_t* offsets,
                        int32_t* source, int32_t* row_of);

// As cpu::moe_drop_to_capacity (NOTE [MoE capacity] in ops/moe.h), after moe_sort_by_expert
// wrote sorted and sorted_offsets: kept_offsets [experts + 1], source [pad ? experts *
// capacity : tokens * k] (-1 at rows without an assignment) and row_of [tokens * k] (-1
// when dropped), the same values as the CPU's. kept_offsets must not alias sorted_offsets.
void moe_drop_to_capacity(const int32_t* sorted, const int64_t* sorted_offsets, const float* weights, int64_t tokens,
                          int64_t k, int64_t experts, int64_t capacity, bool by_position, bool pad,
                          int64_t* kept_offsets, int32_t* source, int32_t* row_of);

// sums [experts] (written over) = the sum over tokens of probs [tokens, experts]'s column,
// in a fixed order (the balancing loss's P, times tokens).
void moe_prob_column_sums(const float* probs, int64_t tokens, int64_t experts, float* sums);

// permuted [rows, hidden]: row r is x's row source[r] / k, or zero where source[r] < 0
// (padding). hidden % 8 == 0.
void moe_permute(bf16* permuted, const bf16* x, const int32_t* source, int64_t rows, int64_t k, int64_t hidden);

// rows [n, hidden]: each row r with source[r] < 0 (padding) written zero, the others left.
void moe_zero_padding(bf16* rows, const int32_t* source, int64_t n, int64_t hidden);

// dx [tokens, hidden] (written over): the sum, in fp32, of rows row_of[t * k + j] of
// d_permuted over j (one rounding), skipping row_of < 0 (dropped).
void moe_permute_backward(bf16* dx, const bf16* d_permuted, const int32_t* row_of, int64_t tokens, int64_t k,
                          int64_t hidden);

// out [tokens, hidden] = residual (null: none; may be out itself) + sum over j of
// weights[t * k + j] x expert_out's row row_of[t * k + j], in fp32 (one rounding); a
// dropped assignment (row_of < 0) adds nothing.
void moe_combine(bf16* out, const bf16* expert_out, const int32_t* row_of, const float* weights, const bf16* residual,
                 int64_t tokens, int64_t k, int64_t hidden);

// d_expert_out [tokens * k, hidden] (written over): row row_of[t * k + j] = weights[t * k +
// j] x dout's row t; d_weights [tokens, k] (written over): dout[t] . expert_out[row_of[t * k
// + j]], summed in fp32 in a fixed order. A dropped assignment (row_of < 0) writes no row
// and a zero weight gradient.
void moe_combine_backward(bf16* d_expert_out, float* d_weights, const bf16* dout, const bf16* expert_out,
                          const int32_t* row_of, const float* weights, int64_t tokens, int64_t k, int64_t hidden);

}  // namespace forge::cuda
