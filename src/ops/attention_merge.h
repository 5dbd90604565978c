// The log-sum-exp merge of two attentions of the same queries over disjoint sets of keys:
// ring attention's step (NOTE [Ring attention] in model/context_parallel_ring.h).
//
// NOTE [Attention merge]
// A query row's attention over keys K1 ∪ K2 (disjoint) from its attentions over each,
// (out1, lse1) and (out2, lse2), lse the log of the softmax's denominator:
//   lse = log(exp(lse1) + exp(lse2)) = m + log(exp(lse1 - m) + exp(lse2 - m)), m = max
//   out = exp(lse1 - lse) out1 + exp(lse2 - lse) out2
// Each weight is at most 1 and the larger one at least 1/2, so nothing overflows; a row that
// saw no key on one side (lse -inf) takes the other side's as it is. The running out is fp32
// (bf16 partial outs on CUDA would round once per step), the running lse is the attention's
// fp32 lse tensor itself. The statistics are [B, H, L] as attention_forward's, or token-major
// [B L, H] as cuDNN's ragged statistics are (packed examples on CUDA: NOTE [Ring attention
// with packed examples] in model/context_parallel_ring.h); both lse tensors in one layout.
#pragma once

#include "core/tensor.h"

namespace forge {

// In place: out fp32 [B, L, H, D] and lse fp32 [B, H, L] become the merge of themselves
// with part_out [B, L, H, D] (fp32, or bf16 on CUDA) and part_lse fp32 [B, H, L]. One device.
// token_major: lse and part_lse hold [B L, H] in their [B, H, L] tensors.
void attention_merge(const Tensor& out, const Tensor& lse, const Tensor& part_out, const Tensor& part_lse,
                     bool token_major = false);

}  // namespace forge
