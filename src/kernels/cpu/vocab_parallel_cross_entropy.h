#pragma once

#include <cstdint>

namespace forge::cpu {

// logits and dlogits are [rows, vocab]: the columns [vocab_begin, vocab_begin + vocab) of
// the full logits. row_max, losses and targets are [rows]; sums is [2, rows]. Targets are
// ids of the full vocabulary or ignore_index (validated by the caller). dlogits may be null
// (no gradient) or equal to logits (computed in place).

// row_max[n] = max over the shard of logits[n].
void vocab_parallel_cross_entropy_max(float* row_max, const float* logits, int64_t rows, int64_t vocab);
// sums[n] = sum over the shard of exp(logits[n] - row_max[n]); sums[rows + n] = the target's
// logit when the shard holds it, else 0. Both 0 on ignored rows.
void vocab_parallel_cross_entropy_sums(float* sums, const float* logits, const float* row_max,
                                       const int32_t* targets, int64_t rows, int64_t vocab, int64_t vocab_begin,
                                       int32_t ignore_index);
// losses[n] = row_max[n] + log(sums[n]) - sums[rows + n]; dlogits = grad_scale * (exp(x - lse)
// - onehot(target)). Ignored rows: loss 0 and a zero gradient.
void vocab_parallel_cross_entropy_finish(float* losses, float* dlogits, const float* logits, const float* row_max,
                                         const float* sums, const int32_t* targets, int64_t rows, int64_t vocab,
                                         int64_t vocab_begin, int32_t ignore_index, float grad_scale);

}  // namespace forge::cpu
