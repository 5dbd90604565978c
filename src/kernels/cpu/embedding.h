#pragma once

#include <cstdint>

namespace forge::cpu {

// tokens is [count], ids of the whole vocabulary; table and dtable are [rows, hidden] and
// hold the vocabulary's rows [vocab_begin, vocab_begin + rows) (vocab_begin = 0 and rows =
// the vocabulary size for a whole table); out and dout are [count, hidden]. Token ids must
// have been validated by the caller; ids outside the table's rows are not an error.
// out[n] = table[tokens[n] - vocab_begin], or zeros when the id is not in the table.
void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t count, int64_t vocab_begin,
                       int64_t rows, int64_t hidden);
// Accumulates: dtable[tokens[n] - vocab_begin] += dout[n] for the ids in the table.
void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t count, int64_t vocab_begin,
                        int64_t rows, int64_t hidden);

}  // namespace forge::cpu
