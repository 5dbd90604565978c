// How a decoder reaches the other ranks of its context-parallel group: the interface the
// model is handed for context parallelism, as it is handed TensorParallel for tensor
// parallelism. model/ never sees a process group; the trainer gives the decoder an
// implementation over one (distributed/context_parallel_group.h).
//
// NOTE [Context parallelism]
// With C > 1 ranks in a context-parallel group, every sequence of a micro-batch is split
// across them: its S tokens are cut into 2C chunks of L = S / (2C), and rank r holds
// chunks r and 2C - 1 - r of every row (Megatron-LM's load balance: under the causal mask
// chunk c's queries see (c + 1) L keys, so each rank's pair sees (2C + 1) L). Every rank of
// the group is handed the same micro-batch, tokens and targets [B, S], and takes its
// chunks of them (take_chunks: a small strided copy per micro-batch). A rank's 2BL tokens
// are laid out chunk-major, [2B, L]: chunk r of every row, then chunk 2C - 1 - r of every
// row, so each chunk of queries is one contiguous [B, L] batch that an op takes whole (NOTE
// [Contiguous tensors]); the rotary positions are the tokens' positions in their sequence.
// Everything but attention works token by token, so the embedding, the norms, the
// projections, the feed-forward, the head and the cross-entropy run on the rank's tokens
// with no communication. Attention is the all-gather form (Megatron's
// cp_comm_type=all_gather, Llama 3's), per layer (model/context_parallel_attention.h):
//   1. the rank's qkv [2B, L, Hq + 2Hkv, D], rotated at the tokens' positions; its key and
//      value heads copied out, [2B, L, 2Hkv, D];
//   2. gathered from every rank of the group (gather, rank order), [C, 2B, L, 2Hkv, D],
//      and put back in sequence order, [B, S, 2Hkv, D] (2C strided copies);
//   3. each of the two query chunks attends to the keys it sees (ops/attention_chunk.h):
//      chunk c's queries to positions [0, (c + 1) L), the causal diagonal at the bottom
//      right. A query's softmax covers all of its keys in one call, so there is no
//      log-sum-exp merge (ring attention's price for overlapping its exchanges).
// The backward gathers the keys and values again (only the rank's qkv is kept per layer,
// C times less than the gathered ones; the gathered K/V are scratch shared by the layers,
// and the layer whose forward ran last finds them still there: the first block of the
// backward, and every block under full recomputation, which reruns the forward just
// before), runs both chunks' backward, which give the chunk's dq and its dk/dv at every
// position, sums the two dk/dv, puts them in rank order and reduce-scatters them over the
// group (reduce_scatter: the sum over ranks of each position's gradient, to the rank that
// holds the position), into dqkv's key/value heads.
// The losses: each rank computes its tokens'; the group sums them (all_reduce_sum) and
// counts the micro-batch's unmasked targets, so every rank returns the micro-batch's
// LossSum. The weight gradients of each rank are partial sums over its tokens; they are
// summed over the group by the data-parallel gradient reduction (a trainer counts the
// ranks of a context-parallel group as data-parallel ranks for gradients, as Megatron
// does), with the micro-batch's grad_scale.
// With tensor parallelism (NOTE [Tensor parallelism] in model/tensor_parallel.h), T x C
// ranks: each tensor-parallel group computes on its context-parallel rank's tokens, the
// attention computes the rank's heads on all of those tokens, and the context-parallel
// group (the ranks of the same tensor-parallel rank) gathers and reduce-scatters the keys
// and values of those heads only.
// Packed examples (SequenceLayout, NOTE [Packed examples] in ops/attention.h): every rank is
// handed the micro-batch's positions and segment ids [B, S] with its tokens. The positions
// are per token and restart with each example, so the rank takes its chunks of them as of the
// tokens (its rotary positions); the segment ids give each of its two query chunks the
// examples it meets, keys from each example's first position (on whichever rank's chunk it
// began) to the chunk's end (NOTE [Chunk attention with packed examples] in
// ops/attention_chunk.h), built on the host once per micro-batch and used by every layer. The
// gathered keys and values, the reduce-scatter of their gradients and the losses (the
// targets at example boundaries are masked by the data, as without context parallelism) do
// not change.
// parallelism.context_parallel_rotate_method "p2p" replaces steps 1-3 and the backward's
// gather and reduce-scatter by ring attention (NOTE [Ring attention] in
// model/context_parallel_ring.h): the same chunks and the same results, no rank holding more
// than two ranks' keys and values, its exchanges overlapped with the attention on CUDA.
// Not taken: Multi-head Latent Attention and
// Mixture-of-Experts blocks (check_context_parallel), and forward_logits (no rank holds
// every token's logits). The collectives run on the compute stream, between the kernels
// that produce and consume their rows (not overlapped with the attention).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace forge {

// How a context-parallel attention reaches the other ranks' keys and values
// (parallelism.context_parallel_rotate_method, torchtitan's key): AllGather gathers them all
// (NOTE above, "allgather"); Ring passes them around the group, one block a step, and merges
// the partial attentions (NOTE [Ring attention] in model/context_parallel_ring.h, "p2p",
// Megatron-LM's cp_comm_type name).
enum class ContextParallelRotate { AllGather, Ring };
// "allgather" or "p2p"; anything else fails naming the key.
ContextParallelRotate parse_context_parallel_rotate(const std::string& name);

// Fails, naming the keys, unless `degree` context-parallel ranks can split sequences of
// `seq_len` tokens of `config`'s model: a dense Llama-family model (not Multi-head Latent
// Attention, not Mixture-of-Experts) and 2 x degree chunks that divide the sequence.
void check_context_parallel(const ModelConfig& config, int64_t degree, int64_t seq_len);

class ContextParallel {
 public:
  virtual ~ContextParallel() = default;

  // This rank's place in its context-parallel group, and the group's size (C).
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // `full` [C n, ...] becomes every rank's `local` [n, ...], in rank order.
  virtual void gather(const Tensor& full, const Tensor& local) = 0;
  // `local` [n, ...] becomes the sum over the group's ranks of their `full` rows
  // [rank() n, (rank() + 1) n).
  virtual void reduce_scatter(const Tensor& local, const Tensor& full) = 0;
  // In place: the elementwise sum over the group's ranks.
  virtual void all_reduce_sum(const Tensor& tensor) = 0;
  // One step of a ring: each of `sent` goes to the next rank, (rank() + 1) mod C, and each of
  // `received` (the same byte counts, in the same order) is filled from the previous one.
  // The tensors of `received` must not overlap those of `sent`. Every rank starts the same
  // steps in the same order. rotate_start may return before the step is done (on CUDA it
  // runs on a communication stream after the work already enqueued), so the caller may
  // enqueue other work, which must neither write `sent` nor touch `received`, and then calls
  // rotate_wait: work enqueued after it sees every step started so far done.
  virtual void rotate_start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) = 0;
  virtual void rotate_wait() {}
  void rotate(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) {
    rotate_start(received, sent);
    rotate_wait();
  }

  // Which attention the model's blocks run (ContextParallelRotate); AllGather unless set,
  // before the decoder lays out its activations.
  ContextParallelRotate rotate_method() const { return rotate_method_; }
  void set_rotate_method(ContextParallelRotate method) { rotate_method_ = method; }

 private:
  ContextParallelRotate rotate_method_ = ContextParallelRotate::AllGather;
};

// The chunk of the sequence (of 2 size) that rank `rank` holds as its `half` (0 or 1):
// rank, then 2 size - 1 - rank.
int64_t context_parallel_chunk(int rank, int size, int half);

// `local` [2B, L, ...] becomes rank `rank`'s two chunks of every row of `sequences`
// [B, S, ...] (S = 2 size L; chunk-major, NOTE above); put_chunks is the reverse. Any dtype,
// one device.
void take_chunks(const Tensor& local, const Tensor& sequences, int rank, int size);
void put_chunks(const Tensor& sequences, const Tensor& local, int rank, int size);

}  // namespace forge
