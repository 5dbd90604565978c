// Ring attention for context parallelism: the keys and values pass around the
// context-parallel group one rank's block at a time instead of being gathered
// (parallelism.context_parallel_rotate_method "p2p"). ContextParallelAttention holds one and
// hands it the layer's attention when the group's rotate method is Ring.
//
// NOTE [Ring attention]
// The tokens are laid out as for the all-gather (NOTE [Context parallelism] in
// model/context_parallel.h): rank r of C holds query chunks a = r and b = 2C - 1 - r of every
// row, [2B, L] chunk-major, and the keys and values of the same two chunks, its block
// [2B, L, 2Hkv, D]. Forward, C steps; at step s the rank holds the block of rank
// q = (r - s) mod C (its own at step 0), with key chunks q and 2C - 1 - q. Each of the four
// (query chunk, key chunk) pairs is one of (ring_chunk_pair):
//   key chunk before the query chunk   Full: every query sees every key (NOTE [Full chunk
//                                      attention] in ops/attention_chunk.h)
//   the same chunk                     Diagonal: the causal chunk attention at position 0
//   key chunk after the query chunk    Skipped: entirely in the queries' future
// With the load-balanced chunks that gives, per step:
//   s = 0 (q = r):  a x a Diagonal, b x a Full, b x b Diagonal; a x (2C-1-r) Skipped
//   q < r:          a x q Full, b x q Full; both queries' pairs with 2C-1-q Skipped
//   q > r:          b x q Full, b x (2C-1-q) Full; a's pairs Skipped
// so every step after the first computes two L x L blocks per row, on every rank: the ring
// is balanced as the all-gather is. Each computed pair gives a partial out and lse for its
// query chunk, merged into the running ones (NOTE [Attention merge] in ops/attention_merge.h:
// out in fp32, lse the layer's fp32 lse tensor); the first pair of each query chunk (at step
// 0) starts them. At the start of each step but the last the held block is sent to rank
// r + 1 and the block of rank r - 1 received into the other of two buffers
// (ContextParallel::rotate_start, one send_recv), while the step's pairs are computed; the
// step ends waiting for it (rotate_wait). C - 1 rotations. At the end the fp32 out is rounded
// into the layer's out; lse is the global log-sum-exp of each query over every key it sees,
// the all-gather's.
// Backward, with the layer's final out and lse (the softmax of a pair's scores recomputed
// with the global lse is the pair's share of the global probabilities, and dO . O is the
// global correction), the same C steps, pairs and block rotations: each pair's chunk backward
// gives its dq, summed into an fp32 dq of the rank's queries, and the dk/dv of the held key
// chunk, summed into an fp32 step gradient. The held block's gradient travels one step
// behind the block: after the step's pairs the rank waits for the block's gradient from the
// ranks that held it before (sent by rank r - 1 at the end of its previous step), adds its
// step gradient, and sends the sum on to r + 1 during its next step (double-buffered too).
// After the last step that sum goes to the block's owner: every rank receives the sum over
// all queries of its own keys' and values' gradients, which goes into dqkv's key/value heads;
// dq, rounded, into its query heads. C - 1 block and C gradient rotations.
// The results equal the all-gather's up to the order of floating-point sums. What differs:
// no rank holds more than two blocks (the all-gather holds the whole sequence's), and the
// exchange is point-to-point steps hidden behind the steps' attention instead of one gather
// and one reduce-scatter in the open. On CUDA the group's steps run on a stream of their own
// (distributed/context_parallel_group.h), ordered by events; the CPU group's, and the test
// groups', are done when rotate_start returns. With a sliding window, NOTE [Ring attention
// with a sliding window]. Not taken under the ring (refused by the config's validation):
// packed examples (segments per pair of chunks; cuDNN's ragged statistics are token-major, the
// merge's are not).
//
// NOTE [Ring attention with a sliding window]
// Mistral's window W: query position u sees key position v when 0 <= u - v < W. The chunks
// are L long; query chunk a against key chunk k are d = (a - k) L positions apart, so query i
// and key j of the pair (at aL + i and kL + j) are d + i - j apart, and with t = W - d:
//   k > a                     Skipped: the keys are in the queries' future
//   k = a                     Diagonal: the causal chunk attention at position 0 with the
//                             window, which keeps its band inside the chunk
//   k < a, t >= L             Full: the farthest pair, d + L - 1 apart, is inside the window
//   k < a, t <= 1 - L         Skipped: the nearest pair, d - L + 1 apart, is outside it
//   k < a, 1 <= t < L         Band: query i sees the keys j > i - t, every query some
//   k < a, 1 - L < t <= 0     Trimmed band: only the keys [1 - t, L) are seen, by the queries
//                             [0, L - 1 + t); the others see none of the pair's keys
// (ring_chunk_pair). A band is the full chunk attention with the window and kv lying d
// positions before the chunk (NOTE [Full chunk attention with a sliding window] in
// ops/attention_chunk.h): a row that sees no key gives out 0 and lse -inf, which the merge
// takes as nothing (NOTE [Attention merge]), and no gradient backward; so a trimmed band may
// start a query chunk's running out and lse. Every query sees its own position (the diagonal,
// computed at step 0), so the final lse is finite. The steps, rotations and merges are the
// windowless ring's; a step whose pairs are all Skipped still passes its block on (the blocks
// and their gradients must reach every rank), and the steps are no longer balanced: with
// W <= L a rank computes only the pairs of neighbouring chunks. On CUDA the band goes through
// cuDNN's diagonal band, and cuDNN takes no single query: the trimmed band of one query and
// one key (L - 1 + t = 1, i.e. W - 2 = (a - k - 1) L for some distance a - k of 1 .. 2C - 1)
// is refused up front by the config's validation, naming model.sliding_window and the chunk
// length (training.seq_len / 2C).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/block_component.h"
#include "model/context_parallel.h"
#include "ops/attention.h"

namespace forge {

enum class RingChunkPair { Skipped, Full, Diagonal, Band, TrimmedBand };
// What query chunk `query_chunk` computes against key chunk `key_chunk` (of the 2C), for
// chunks of `chunk` positions under a sliding window `window` (0: none).
RingChunkPair ring_chunk_pair(int64_t query_chunk, int64_t key_chunk, int64_t chunk = 1, int64_t window = 0);

class ContextParallelRing {
 public:
  // Scratch shared by every layer for `q_heads` query and `kv_heads` key/value heads of
  // `head_dim`, for shape.context_parallel ranks.
  void lay_out(ArenaLayout& layout, const StepShape& shape, int64_t q_heads, int64_t kv_heads, int64_t head_dim);
  // qkv [2B, L, Hq + 2Hkv, D] (rotated), out [2B, L, Hq, D], lse [2B, Hq, L]: as
  // ContextParallelAttention::forward's.
  void forward(ContextParallel& cp, const Tensor& out, const Tensor& lse, const Tensor& qkv,
               const AttentionShape& shape);
  // Overwrites dqkv (same packing as qkv) from dout [2B, L, Hq, D], with the forward's out
  // and lse.
  void backward(ContextParallel& cp, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv, const Tensor& out,
                const Tensor& lse, const AttentionShape& shape);

 private:
  // The rank's keys and values of qkv into kv_[0].
  void take_own_block(const Tensor& qkv);
  // Rows [half B, (half + 1) B) of a [2B, ...] tensor: one chunk of every row.
  Tensor half_of(const Tensor& t, int half) const { return t.narrow(half * batch_, (half + 1) * batch_); }

  int64_t batch_ = 0, chunk_ = 0, q_heads_ = 0;  // B, L, Hq
  Tensor kv_[2];        // [2B, L, 2Hkv, D]: the held block and the one arriving
  Tensor dkv_[2];       // fp32 [2B, L, 2Hkv, D]: the held block's gradient and the one arriving
  Tensor step_grad_;    // fp32 [2B, L, 2Hkv, D]: the held block's gradient from this rank's queries
  Tensor accumulator_;  // fp32: the running out [2B, L, Hq, D] forward, dq [2B, L, Hq + 2Hkv, D] backward
  Tensor part_out_;     // [B, L, Hq, D]: one pair's out
  Tensor part_lse_;     // fp32 [B, Hq, L]: its lse
  Tensor part_dqkv_;    // [B, L, Hq + 2Hkv, D]: one pair's dq (its key/value heads zero)
  Tensor part_dkv_;     // [B, L, 2Hkv, D]: one pair's dk/dv
};

}  // namespace forge
