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
// with a sliding window]; with packed examples, NOTE [Ring attention with packed examples].
//
// NOTE [Ring attention with packed examples]
// With packed examples (NOTE [Chunk attention with packed examples] in ops/attention_chunk.h)
// a query sees the keys of its own example only. The pairs are the windowless ring's, each
// with segments of its own, built on the host once per micro-batch from the micro-batch's
// segment ids (every rank reads the whole micro-batch) for every pair the rank computes
// (2 query chunks x C blocks x 2 key chunks) and reused by every layer:
//   Diagonal   the causal chunk attention at position 0 per example, each example's keys
//              from its first position in the chunk (the earlier ones are other pairs')
//   Full       NOTE [Full chunk attention with packed examples]: only the example running at
//              the query chunk's start can reach back into the key chunk; its queries see the
//              keys of the chunk from the example's start on, all of them, the other queries
//              none (out 0, lse -inf: nothing in the merge, no gradient)
// A Full pair that no query of any row sees (the usual case for chunks far apart: an example
// would have to span them) is skipped like a Skipped one; its block still travels. The
// diagonal is always computed, so the final lse is finite. On CUDA the pairs are cuDNN's
// ragged form, whose statistics are token-major [B L, Hq]: the partial and the running lse
// (the layer's lse tensor, as the all-gather's under packed examples) are then all
// token-major, and the merge reads them so (its token_major flag; where an lse and its out
// row have the same index); no copy. On the CPU they stay [B, Hq, L]. Not with a sliding
// window (refused by the config's validation and set_layout, naming model.sliding_window
// and data.source): a Full pair would be a band of one example's rows at an offset into the
// key chunk, which the windowed bands here (cuDNN's band over whole rows) do not describe.
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
#include <vector>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/block_component.h"
#include "model/context_parallel.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"

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
  // The micro-batch's packed examples, segment ids int32 [B, S] on the CPU (null: each row
  // one sequence): every computed pair's segments on `device` (NOTE [Ring attention with
  // packed examples]). After lay_out.
  void set_layout(const ContextParallel& cp, const Tensor* segment_ids, const AttentionShape& attention,
                  Device device);
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
  // What the pair computes and its packed examples (null: none); Skipped also for a packed
  // pair where no query sees a key.
  RingChunkPair pair_of(int half, int owner, int key_half, int ranks, int rank, int64_t window,
                        const AttentionChunkSegments** segments) const;
  // The pair's place in pair_segments_.
  static size_t pair_index(int half, int owner, int key_half, int ranks) {
    return static_cast<size_t>((half * ranks + owner) * 2 + key_half);
  }

  int64_t batch_ = 0, chunk_ = 0, q_heads_ = 0;  // B, L, Hq
  Tensor kv_[2];        // [2B, L, 2Hkv, D]: the held block and the one arriving
  Tensor dkv_[2];       // fp32 [2B, L, 2Hkv, D]: the held block's gradient and the one arriving
  Tensor step_grad_;    // fp32 [2B, L, 2Hkv, D]: the held block's gradient from this rank's queries
  Tensor accumulator_;  // fp32: the running out [2B, L, Hq, D] forward, dq [2B, L, Hq + 2Hkv, D] backward
  Tensor part_out_;     // [B, L, Hq, D]: one pair's out
  Tensor part_lse_;     // fp32 [B, Hq, L]: its lse
  Tensor part_dqkv_;    // [B, L, Hq + 2Hkv, D]: one pair's dq (its key/value heads zero)
  Tensor part_dkv_;     // [B, L, 2Hkv, D]: one pair's dk/dv
  bool packed_ = false;
  std::vector<AttentionChunkSegments> pair_segments_;  // [2 halves][C owners][2 key halves]
  Tensor segment_buffer_;  // CUDA: the device memory of their lengths and offsets
};

}  // namespace forge
