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
// The head dim is one for queries, keys and values (NOTE [Value head dim]'s 4-D form).
// Without segments each row of the batch is one sequence; with them, NOTE [Chunk attention
// with packed examples].
//
// NOTE [Full chunk attention]
// With AttentionShape::causal false the chunk sees every key of kv: query i attends to keys
// [0, S) whatever its place, as when all of kv lies before the chunk in the sequence. Ring
// attention (NOTE [Ring attention] in model/context_parallel_ring.h) computes a query chunk
// against a key chunk that lies wholly in its past this way, and the chunk against its own
// keys as the causal form at position 0. It takes position 0, no packed examples, and any
// number of queries against any number of keys; the backward's dkv is then the gradient at
// every position of kv. With a sliding window, NOTE [Full chunk attention with a sliding
// window].
//
// NOTE [Full chunk attention with a sliding window]
// Not causal with a window W > 0, kv [B, S] still lies wholly before the chunk, and
// `position` says where: the chunk's first query is d = position >= S positions after kv's
// first key, so query i (at d + i) sees key j (at j) when d + i - j < W, i.e. the keys
// j > i - t, t = W - d, of kv: a band whose diagonal is offset by d, with no causal bound
// inside kv (every key lies before every query). The rows of a pair of chunks d apart under
// Mistral's window, for ring attention (NOTE [Ring attention with a sliding window]). With
// t >= Lq every query sees every key (the full chunk); with t >= 1 query i sees the keys from
// max(0, i - t + 1) on (a band); with t <= 0 only the keys from k0 = 1 - t on are seen at
// all, by the queries i < S - k0 (a trimmed band); a query that sees no key gets out 0 and lse
// -inf, which the log-sum-exp merge (NOTE [Attention merge]) takes as no contribution, and no
// gradient. On CUDA the band is cuDNN's diagonal band with the diagonal at the top left, the
// left bound t and a right bound past every key; the trimmed band reads the queries
// [0, S - k0) and the keys [k0, S) with the left bound 1 (kernels/cuda/attention.cpp), which
// needs Lq <= S and, as every cuDNN attention, at least 2 queries: S - k0 >= 2.
//
// NOTE [Chunk attention with packed examples]
// With packed examples (NOTE [Packed examples] in ops/attention.h) a query at position t of
// its row sees the keys j <= t (within the window) of its own example only: from the
// example's first position s(t) on. A chunk [p, p + Lq) then meets some examples of each row:
// those that end after p and start before p + Lq; one may start before the chunk (it began on
// an earlier chunk, possibly another rank's), one may run past it, one may be longer than the
// chunk and cover it whole. Each such example e = [s, t) is, for the chunk, one attention
// problem: its queries are its positions inside the chunk, [max(s, p), min(t, p + Lq)), and
// its keys its positions from its start to the chunk's end, [s, min(t, p + Lq)), all in kv
// (the whole rows), with the causal diagonal at the bottom right: the last query sees the
// last key, so query max(s, p) + i sees keys s .. max(s, p) + i. Those are exactly the keys
// the whole-sequence packed attention gives it, so out and lse rows, dq rows and (summed over
// a partition of [0, S) into chunks) dk and dv are the whole sequence's.
// AttentionChunkSegments holds that layout for one chunk, built on the host once per
// micro-batch (the decoder's every layer reuses it):
//   CPU: example_start int32 [B, S], the first position of each token's example (as in
//        AttentionSegments): query t's keys start at max(example_start[t], t - W + 1).
//   CUDA: cuDNN's ragged ("THD") form with the queries and the keys described apart: per
//        example of the chunk, the number of its query rows and the element offset of the
//        first in the chunk's qkv, out and lse (token-major [B Lq, Hq], as ragged statistics
//        are), and the number of its key rows and the element offset of the first in kv. The
//        padding mask confines each query to its example's keys; cuDNN aligns the causal
//        diagonal (and the window's left bound) at the bottom right of each sequence's own
//        lengths (the frontend hands the sequence-length tensors to its diagonal band masks),
//        which is the rule above. The examples are listed row by row and rounded up to a
//        power of two with empty ones, so few graphs are built. kv's rows that no example of
//        the chunk reads (examples that ended before p, positions at or past p + Lq) are not
//        cuDNN's; the backward zeroes dkv before cuDNN writes its examples' rows.
// Padding after a row's last example is a run of its own, computed and ignored, as in the
// whole-sequence attention.
//
// NOTE [Full chunk attention with packed examples]
// Ring attention (NOTE [Ring attention with packed examples] in model/context_parallel_ring.h)
// computes a query chunk [p, p + Lq) against a key chunk [k, k + S) wholly in its past
// (k + S <= p) with packed examples: query p + i sees key k + j when both are in one example,
// i.e. (the examples being runs) when its example began at or before k + j: the keys
// j >= s(p + i) - k. Only the example running at p can have begun before the key chunk's end,
// so per row either no query sees a key, or the queries [0, n) of that example (the first n
// of the chunk) see the keys [k0, S), k0 = max(0, s(p) - k), every one of them: no causal
// mask. AttentionChunkSegments with causal false holds that (from
// attention_chunk_pair_segments, position 0, no window):
//   CPU: first_key int32 [B, Lq], the first key of kv each query sees (S: none);
//   CUDA: the ragged form above with at most one sequence per row (n queries at the chunk's
//        row start, S - k0 keys at kv's row start + k0) and no mask but the padding.
// The queries of no sequence get out 0 and lse -inf (cuDNN does not write them: their rows
// are cleared first), which the merge takes as nothing (NOTE [Attention merge]), and dq 0.
// num_examples counts the sequences on both devices: 0 when no query sees a key, a pair the
// ring skips.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/attention.h"

namespace forge {

// The packed examples a chunk meets (NOTE [Chunk attention with packed examples]), for one
// device.
struct AttentionChunkSegments {
  Device device = Device::CPU;
  int64_t batch = 0, queries = 0, position = 0, kv_seq = 0;  // B, Lq, p, S
  int64_t qkv_width = 0;  // elements per token of the chunk's qkv it was built for
  Tensor example_start;   // CPU: int32 [B, S], each position's example's first position
  // CUDA: `capacity` sequences (the chunk's examples, then empty ones: a power of two), device
  // int32 query and key lengths [capacity] and int64 element offsets [capacity + 1] of each
  // sequence's first query in qkv, out and lse, and of its first key in kv.
  int64_t num_examples = 0, capacity = 0;
  Tensor q_lengths, kv_lengths, q_offsets, out_offsets, lse_offsets, kv_offsets;
  // false: a full chunk's (NOTE [Full chunk attention with packed examples]); CPU: first_key.
  bool causal = true;
  Tensor first_key;
};

// The layout of the chunk attention's lse with these segments (null: none): token-major
// [B Lq, Hq] in its [B, Hq, Lq] tensor on CUDA (cuDNN's ragged statistics), [B, Hq, Lq] else.
inline bool token_major_lse(const AttentionChunkSegments* segments) {
  return segments && segments->device == Device::CUDA;
}

// segment_ids: int32 [B, S] on the CPU, a run of equal ids in a row one example; the chunk
// is positions [position, position + queries). shape must set head_dim (CUDA's offsets count
// elements).
AttentionChunkSegments attention_chunk_segments(const Tensor& segment_ids, int64_t position, int64_t queries,
                                                const AttentionShape& shape, Device device);
// CUDA's form (the lengths and offsets) on the host: what attention_chunk_segments uploads
// for a CUDA device, for tests that read it as cuDNN does.
AttentionChunkSegments attention_chunk_ragged_on_host(const Tensor& segment_ids, int64_t position, int64_t queries,
                                                      const AttentionShape& shape);

// Ring attention's pair (NOTE [Ring attention with packed examples] in
// model/context_parallel_ring.h): `length` queries at query_position against the `length`
// keys at key_position, the query chunk's own (equal positions: the causal chunk attention at
// position 0, each example's keys from its first position in the chunk) or a chunk wholly in
// its past (NOTE [Full chunk attention with packed examples]).
AttentionChunkSegments attention_chunk_pair_segments(const Tensor& segment_ids, int64_t query_position,
                                                     int64_t key_position, int64_t length,
                                                     const AttentionShape& shape, Device device);
// Several chunks' CUDA forms, built on the host (attention_chunk_pair_ragged_on_host), moved
// to `device` in one copy: their lengths and offsets become views of the returned buffer,
// which must outlive them (one allocation and one transfer per micro-batch for ring
// attention's 2C + 1 pairs, instead of six of each per pair).
Tensor upload_chunk_segments(std::vector<AttentionChunkSegments>& segments, Device device);
// CUDA's form of a pair's segments on the host, for tests and upload_chunk_segments.
AttentionChunkSegments attention_chunk_pair_ragged_on_host(const Tensor& segment_ids, int64_t query_position,
                                                           int64_t key_position, int64_t length,
                                                           const AttentionShape& shape);

// position: p, the chunk's first position in the sequences kv holds. segments: the packed
// examples of the chunk at p (null: each row is one sequence).
void attention_chunk_forward(const Tensor& out, const Tensor& lse, const Tensor& qkv, const Tensor& kv,
                             int64_t position, const AttentionShape& shape,
                             const AttentionChunkSegments* segments = nullptr);
void attention_chunk_backward(const Tensor& dqkv, const Tensor& dkv, const Tensor& dout, const Tensor& qkv,
                              const Tensor& kv, const Tensor& out, const Tensor& lse, int64_t position,
                              const AttentionShape& shape, const AttentionChunkSegments* segments = nullptr);

}  // namespace forge
