#pragma once

#include <cstdint>

namespace forge::cpu {

// tokens is [count], each in [0, vocab); table and dtable are [vocab, hidden]; out and dout
// are [count, hidden]. Token ids must have been validated by the caller.
void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t count, int64_t hidden);
// Accumulates: dtable[tokens[n]] += dout[n].
void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t count, int64_t vocab,
                        int64_t hidden);

}  // namespace forge::cpu
