// Softmax cross-entropy over logits whose vocabulary is split across the ranks of a
// tensor-parallel group: computes exactly what cross_entropy_forward_backward computes over
// the full logits [N, V], while each rank holds only its columns.
//
// NOTE [Vocabulary-parallel cross-entropy]
// With the output head split by vocabulary (Megatron's vocab-parallel head), rank r holds
// logits [N, Vs]: the columns [vocab_begin, vocab_begin + Vs) of the full logits. Targets
// [N] are ids of the full vocabulary, the same on every rank. The loss needs three numbers
// per row from the whole vocabulary: its max m, the sum of exp(x - m) and the target's
// logit. They come from three phases with the caller's collectives between them (these ops
// never communicate):
//   1. vocab_parallel_cross_entropy_max: row_max [N] = each row's max over the shard.
//      Caller: all-reduce MAX of row_max over the group.
//   2. vocab_parallel_cross_entropy_sums: sums [2, N], row 0 = sum over the shard of
//      exp(x - row_max), row 1 = the target's logit where the target is in the shard, else 0.
//      Both are 0 on ignored rows, which are not read. Caller: all-reduce SUM of sums (one
//      collective for both).
//   3. vocab_parallel_cross_entropy_finish: losses [N] = row_max + log(sums[0]) - sums[1],
//      the same on every rank (0 on ignored rows), and when dlogits [N, Vs] is defined (it
//      may alias logits) the shard's columns of the gradient of grad_scale * sum_n losses[n]:
//      grad_scale * (exp(x - lse) - onehot(target)), 0 on ignored rows.
// Concatenating every rank's dlogits gives cross_entropy_forward_backward's dlogits.
//
// The full vocabulary size is not known here, so the CPU checks of targets are what these
// ops can see: every target is ignore_index or >= 0. Targets past the vocabulary would
// belong to no shard and give the loss lse; they are the data layer's to reject (and on the
// GPU targets are not read back for checking at all, as in cross_entropy).
// CPU: fp32 logits. CUDA: bf16 logits and dlogits; row_max, sums and losses fp32; targets int32.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

void vocab_parallel_cross_entropy_max(const Tensor& row_max, const Tensor& logits);

void vocab_parallel_cross_entropy_sums(const Tensor& sums, const Tensor& logits, const Tensor& row_max,
                                       const Tensor& targets, int64_t vocab_begin, int32_t ignore_index);

void vocab_parallel_cross_entropy_finish(const Tensor& losses, const Tensor& dlogits, const Tensor& logits,
                                         const Tensor& row_max, const Tensor& sums, const Tensor& targets,
                                         int64_t vocab_begin, int32_t ignore_index, float grad_scale);

}  // namespace forge
