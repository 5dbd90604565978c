#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// logits bf16 [rows, vocab]: the columns [vocab_begin, vocab_begin + vocab) of the full
// logits; targets int32 [rows], ids of the full vocabulary or ignore_index; row_max and
// losses fp32 [rows]; sums fp32 [2, rows]. The three phases of NOTE [Vocabulary-parallel
// cross-entropy]; dlogits (bf16, may be null or equal to logits) receives the shard's
// columns of grad_scale * (softmax - onehot), zero on ignored rows.
void vocab_parallel_cross_entropy_max(float* row_max, const bf16* logits, int64_t rows, int64_t vocab);
void vocab_parallel_cross_entropy_sums(float* sums, const bf16* logits, const float* row_max, const int32_t* targets,
                                       int64_t rows, int64_t vocab, int64_t vocab_begin, int32_t ignore_index);
void vocab_parallel_cross_entropy_finish(float* losses, bf16* dlogits, const bf16* logits, const float* row_max,
                                         const float* sums, const int32_t* targets, int64_t rows, int64_t vocab,
                                         int64_t vocab_begin, int32_t ignore_index, float grad_scale);

}  // namespace forge::cuda
