#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// tokens int32 [count] in [0, vocab) (validated where the batch is made); table bf16
// [vocab, hidden]; out bf16 [count, hidden].
void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t count, int64_t hidden);
// Accumulates dtable (fp32 [vocab, hidden]) += rows of dout (bf16 [count, hidden]).
void embedding_backward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t count, int64_t hidden);

}  // namespace forge::cuda
