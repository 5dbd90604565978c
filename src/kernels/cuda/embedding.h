#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// tokens int32 [count], ids of the whole vocabulary (validated where the batch is made);
// table bf16 [rows, hidden] and dtable fp32 [rows, hidden] hold the vocabulary's rows
// [vocab_begin, vocab_begin + rows) (0 and the vocabulary size for a whole table).
// out bf16 [count, hidden] = table[tokens[n] - vocab_begin], zeros for ids not in the table.
void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t count, int64_t vocab_begin,
                       int64_t rows, int64_t hidden);
// Accumulates dtable += the rows of dout (bf16 [count, hidden]) whose ids are in the table.
void embedding_backward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t count, int64_t vocab_begin,
                        int64_t rows, int64_t hidden);

}  // namespace forge::cuda
