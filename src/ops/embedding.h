// Token embedding lookup: out[n, :] = table[tokens[n], :], tokens int32 [N], table [V, H].
// The backward ACCUMULATES rows into dtable (dtable[tokens[n]] += dout[n]) in a fixed
// order, so repeated tokens sum deterministically.
//
// NOTE [Vocabulary-parallel embedding]
// Under tensor parallelism (degree T) each rank holds a shard of the table: the rows
// [vocab_begin, vocab_begin + Vs) of the full [vocab_size, H] table. The token ids stay
// ids of the full vocabulary, the same on every rank. A shard looks up the ids it holds
// and writes zeros for the others, so the sum of every shard's output (the caller's
// all-reduce) is the full lookup; its backward adds the rows of the ids it holds and
// ignores the others. embedding_forward / embedding_backward are the shard that starts at
// 0 and holds the whole vocabulary.
//
// On the CPU token ids are validated against [0, vocab_size), with an error naming the id
// and its position; on the GPU they were validated when the batch was made (data layer).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

void embedding_forward(const Tensor& out, const Tensor& tokens, const Tensor& table);
void embedding_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens);

// table [Vs, H] holds the rows [vocab_begin, vocab_begin + Vs) of a [vocab_size, H] table;
// out [N, H] = its rows for the ids it holds, zeros for the others.
void embedding_shard_forward(const Tensor& out, const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                             int64_t vocab_size);
// dtable [Vs, H] (the same shard) += the rows of dout [N, H] whose ids it holds.
void embedding_shard_backward(const Tensor& dtable, const Tensor& dout, const Tensor& tokens, int64_t vocab_begin,
                              int64_t vocab_size);

}  // namespace forge
