// Causal grouped-query attention of a chunk of queries against keys and values held apart
// from them: the attention each rank computes under context parallelism (NOTE [Context
// parallelism] in model/context_parallel.h).
//
// NOTE [Chunk attention]
// The chunk is Lq consecutive positions [p, p + Lq) of every sequence of a batch; kv holds
// the sequences' keys and values at positions [0, S), S >= p + Lq. Query i of the chunk is
// at position p + i and sees the keys at positions j <= p + i (and p + i - j < W with a
// sliding window W): the causal mask of the square attention with its diagonal aligned to
// the bottom right of the keys [0, p + Lq) the chunk can see, so the chunk's out and lse
// rows are exactly those attention_forward gives positions [p, p + Lq) of the whole
// sequences, and the chunks of a partition of [0, S) together give its dq rows and, summed,
// its dk and dv.
//   qkv  [B, Lq, Hq + 2 Hkv, D]  the chunk's packed projections (ops/attention.h); only the
//                                query heads are read
//   kv   [B, S, 2 Hkv, D]        per token the Hkv key heads, then the Hkv value heads (the
//                                key/value part of a token's row of qkv)
//   out  [B, Lq, Hq, D], lse [B, Hq, Lq] fp32: as attention_forward's
// The backward writes dq into dqkv's query heads (leaving its key/value heads as they were)
// and overwrites dkv [B, S, 2 Hkv, D] with the gradient of the chunk's outputs with respect
// to every key and value: zero past position p + Lq - 1, which the chunk does not see.
// The head dim is one for queries, keys and values (NOTE [Value head dim]'s 4-D form), and
// packed examples are not taken: each row of the batch is one sequence.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "ops/attention.h"

namespace forge {

// position: p, the chunk's first position in the sequences kv holds.
void attention_chunk_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                             int64_t position, const AttentionShape& shape);
void attention_chunk_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& kv, const Tensor& out, const Tensor& lse, int64_t position,
                              const AttentionShape& shape);

}  // namespace forge
