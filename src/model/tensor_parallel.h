// How a decoder reaches the other ranks of its tensor-parallel group: the interface the
// model is handed for tensor parallelism, as it is handed ParamSource / GradSink for its
// weights and ExpertDispatch for expert parallelism. model/ never sees a process group;
// the trainer gives the decoder an implementation over one
// (distributed/tensor_parallel_group.h).
//
// NOTE [Tensor parallelism]
// With parallelism.tensor_parallel_degree T > 1, T consecutive ranks form a
// tensor-parallel group (inside a node: its collectives are the busiest of a step). Every
// rank of a group reads the same micro-batch; each holds a shard of every weight (NOTE
// [Tensor-parallel shards] in model/parameters.h) and computes, as Megatron-LM does with
// sequence parallelism:
//   - the residual stream, the norms and the residual adds on its rows of the micro-batch:
//     rows [r N/T, (r + 1) N/T) of the N = micro_batch x seq_len tokens, flattened (the
//     sequence-parallel region: every per-token activation outside the projections is
//     1/T of the whole);
//   - attention on its heads: the normalized rows of all ranks gathered (gather_rows) into
//     the N rows the column-parallel qkv projection reads; its heads' attention, then the
//     row-parallel o projection, whose partial sums over heads are summed and scattered
//     back to each rank's rows in one reduce-scatter (reduce_scatter_rows) before the
//     residual add;
//   - the feed-forward the same way: gather, column-parallel gate/up (its F/T columns),
//     SwiGLU, row-parallel down, reduce-scatter;
//   - the vocabulary-parallel embedding (each rank looks up the tokens of its vocabulary
//     rows, zeros elsewhere; the reduce-scatter sums and splits them) and output head
//     (the final norm's rows gathered, logits for the rank's vocabulary columns, the
//     cross-entropy's row maximum, sum of exponentials and target logit all-reduced:
//     ops/vocab_parallel_cross_entropy.h; the full logits never exist on any rank).
// The backward is the mirror image: where the forward gathers, the backward
// reduce-scatters (the input gradient of a column-parallel projection is a partial sum
// over its shard) and where the forward reduce-scatters, the backward gathers. The
// normalized rows are kept per layer as the rank's rows only and gathered again in the
// backward for the weight gradients (Megatron's choice: one more all-gather, T times
// less activation memory). A norm weight is replicated; each rank's gradient of it comes
// from its rows only, so the group sums it (all_reduce_sum) before it is added to the
// gradient buffer. The losses are every row's, the same on every rank of the group.
// The collectives run on the compute stream, between the kernels that produce and consume
// their rows; with parallelism.enable_async_tensor_parallel the blocks' run around a ring
// under their GEMMs instead (NOTE [Async tensor parallelism] in model/sequence_parallel.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "ops/fp8_amax_group.h"

namespace forge {

// Fails, naming the model's keys, unless `config` splits over `degree` tensor-parallel
// ranks: a dense Llama-family model (not Multi-head Latent Attention, not
// Mixture-of-Experts) whose query heads, key/value heads, feed-forward width and vocabulary
// the degree divides.
void check_tensor_parallel(const ModelConfig& config, int64_t degree);
// The parameters one rank of `degree` tensor-parallel ranks holds (NOTE [Tensor-parallel
// shards] in model/parameters.h): every rank holds as many.
int64_t tensor_parallel_rank_parameters(const ModelConfig& config, int64_t degree);

// The group is also the one over which FP8 projections agree on their amaxes (NOTE [FP8
// under tensor parallelism] in model/fp8_projections.h): all_reduce_max serves both.
class TensorParallel : public Fp8AmaxGroup {
 public:
  ~TensorParallel() override = default;

  // This rank's place in its tensor-parallel group, and the group's size (T).
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // `full` [T n, ...] becomes every rank's `local` [n, ...], in rank order.
  virtual void gather_rows(const Tensor& full, const Tensor& local) = 0;
  // `local` [n, ...] becomes the sum over the group's ranks of their `full` rows
  // [rank() n, (rank() + 1) n).
  virtual void reduce_scatter_rows(const Tensor& local, const Tensor& full) = 0;
  // In place: the elementwise sum (maximum) over the group's ranks.
  virtual void all_reduce_sum(const Tensor& tensor) = 0;
  void all_reduce_max(const Tensor& tensor) override = 0;

  // NOTE [Async tensor parallelism] in model/sequence_parallel.h: one step of the ring, every
  // tensor of `sent` to the next rank (rank() + 1 mod size()) and of `received` from the
  // previous, paired in order (as ContextParallel::rotate_start). Every rank starts the same
  // steps in the same order. ring_start may return before the step is done (on CUDA it runs
  // on a stream of its own, after the work enqueued so far); work enqueued after ring_wait
  // sees every step started so far done.
  virtual void ring_start(const std::vector<Tensor>& received, const std::vector<Tensor>& sent) = 0;
  virtual void ring_wait() {}

  // parallelism.enable_async_tensor_parallel: the blocks' all-gathers and reduce-scatters
  // run as ring steps interleaved with their GEMMs' row chunks.
  bool async() const { return async_; }
  void set_async(bool async) { async_ = async; }

 private:
  bool async_ = false;
};

}  // namespace forge
