// One residual sublayer of a decoder block, the unit blocks are composed of.
//
// NOTE [Composed blocks]
// A decoder block is a sequence of components, each a residual sublayer out = x + f(x)
// that owns everything of f: its parameters (param_specs: forge and Hugging Face names,
// shapes, initialization), its activations (what it keeps per layer under each
// activation-checkpointing mode, what it shares across layers and recomputes, its backward
// scratch, all laid out in the model's one arena), and its forward, recomputation and
// backward. The Llama family's block is an attention component (self_attention.h: GQA,
// MHA, sliding window) followed by a feed-forward component (swiglu_feed_forward.h);
// block_components.h chooses them from ModelConfig. A new attention (MLA) or feed-forward
// (MoE) is a new component chosen there, not a branch in the block: the decoder
// (decoder_lm.h) only carries the residual stream from one component to the next and asks
// each to do its part. Components never see where their weights come from or where their
// gradients go (ComponentWeights, NOTE [Block weights]).
// Activation checkpointing, per component (NOTE [Activation checkpointing]):
//   none       forward keeps all the backward reads; nothing is recomputed;
//   selective  the component keeps what is costly to recompute (GEMM and attention
//              outputs) and recompute_selective() restores the rest before the backward;
//   full       the decoder keeps only each block's input and reruns the block's forward
//              before its backward, the last component without its output
//              (forward(..., nullptr)), so its final projection is skipped.
// Under full checkpointing every per-layer buffer of a component is one shared set.
#pragma once

#include <cstdint>
#include <vector>

#include "core/checked_math.h"
#include "core/tensor.h"
#include "model/activations.h"
#include "model/context_parallel.h"
#include "model/data_parallel_counts.h"
#include "model/expert_dispatch.h"
#include "model/parameters.h"
#include "model/tensor_parallel.h"

namespace forge {

// The tokens of one micro-batch and the dtype its activations are kept in (statistics are
// fp32); expert_parallel: the expert-parallel degree, which sizes what a rank may receive
// (NOTE [Expert parallelism] in model/expert_dispatch.h); tensor_parallel: the
// tensor-parallel degree T, under which the residual stream holds the rank's rows, 1/T of
// its tokens (NOTE [Tensor parallelism] in model/tensor_parallel.h); context_parallel: the
// context-parallel degree C, under which the rank computes on its two chunks of every
// sequence, 1/C of the micro-batch's tokens (NOTE [Context parallelism] in
// model/context_parallel.h).
struct StepShape {
  int64_t micro_batch = 0, seq_len = 0;
  DType dtype = DType::F32;
  int64_t expert_parallel = 1;
  int64_t tensor_parallel = 1;
  int64_t context_parallel = 1;
  // How a context-parallel rank's attention meets the others' keys and values (their
  // scratch differs); a model with a ContextParallel group takes the group's.
  ContextParallelRotate context_parallel_rotate = ContextParallelRotate::AllGather;
  // The rank's tokens as a batch of sequences: [micro_batch, seq_len], or under context
  // parallelism its chunks, [2 micro_batch, seq_len / (2C)] (chunk-major).
  int64_t local_batch() const { return context_parallel > 1 ? 2 * micro_batch : micro_batch; }
  int64_t local_seq_len() const { return context_parallel > 1 ? seq_len / (2 * context_parallel) : seq_len; }
  int64_t tokens() const {
    return mul_or_fail(micro_batch, seq_len, "training.local_batch_size × training.seq_len") / context_parallel;
  }
  int64_t stream_rows() const { return tokens() / tensor_parallel; }
};

// The examples packed into a micro-batch's rows (NOTE [Packed examples] in ops/attention.h),
// on the host, as the data loader makes them.
struct SequenceLayout {
  Tensor positions;  // int32 [micro_batch, seq_len]: each token's position within its example
  Tensor segments;   // int32 [micro_batch, seq_len]: a run of equal ids in a row is one example
};

class BlockComponent {
 public:
  virtual ~BlockComponent() = default;

  // Its parameters in block `layer`, in the order ComponentWeights numbers them.
  virtual std::vector<ParamSpec> param_specs(int layer) const = 0;
  // Places its activations for `num_layers` blocks and its backward scratch (ArenaLayout:
  // called once to count, once more to make the views).
  virtual void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) = 0;
  // Device constants it computes with (rotary tables), made once before the first forward.
  virtual void prepare(const StepShape& shape, Device device) {}
  // The micro-batch's examples, before its forward (null: each row is one sequence). The
  // layout holds for the micro-batch's recomputation and backward too.
  virtual void set_sequence_layout(const SequenceLayout* layout) {}
  // Under expert parallelism, how a Mixture-of-Experts component reaches the other ranks'
  // experts (set before lay_out, outlives the component); ignored by every other component.
  virtual void set_expert_dispatch(ExpertDispatch* dispatch) {}
  // Under data parallelism, how a Mixture-of-Experts component sums counts over the ranks
  // (Megatron's global balancing loss; null: one rank; outlives the component); ignored by
  // every other component.
  virtual void set_data_parallel_counts(DataParallelCounts* counts) {}
  // A new optimizer step begins: what a component kept over the last step's micro-batches
  // is forgotten (the global balancing loss's counts, NOTE [MoE balancing loss]).
  virtual void begin_step() {}
  // Makes this component keep its step state (what begin_step forgets) in `owner`'s, a
  // component of the same kind built from the same config for the same blocks: pipeline
  // parallelism runs one stage's micro-batches in models of their own (NOTE [Global
  // balancing loss across stages] in model/moe_feed_forward.h). Components with no step
  // state ignore it.
  virtual void share_step_state(BlockComponent& owner) {}
  // Whether it computes under tensor parallelism (NOTE [Tensor parallelism] in
  // model/tensor_parallel.h): its parameters split by their ParamSpec::tensor_parallel,
  // its input and output the rank's rows of the residual stream (StepShape::stream_rows).
  virtual bool tensor_parallel_capable() const { return false; }
  // Under tensor parallelism, how it reaches the other ranks of its group (set before
  // lay_out, outlives the component; null: none). Only capable components are given one.
  virtual void set_tensor_parallel(TensorParallel* tp) {}
  // Whether it computes under context parallelism (NOTE [Context parallelism] in
  // model/context_parallel.h): on the rank's chunks of the sequences (StepShape::tokens()).
  virtual bool context_parallel_capable() const { return false; }
  // Under context parallelism, how it reaches the other ranks of its group (set before
  // prepare, outlives the component). Only capable components are given one.
  virtual void set_context_parallel(ContextParallel* cp) {}

  // *out = x + f(x) for block `layer` ([stream rows, hidden]; out may not alias x). With no
  // `out`, only what the backward needs is computed (recomputation, NOTE above).
  virtual void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) = 0;
  // Restores what selective checkpointing dropped, from the block input x.
  virtual void recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) = 0;
  // d_stream holds dL/d(out) and becomes dL/dx (f's share added). The weight gradients go
  // to `grads`, written over them when `overwrite` (NOTE [Fresh gradient buffers]), else
  // added. d_hidden is a [stream rows, hidden] scratch buffer the component may use.
  virtual void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite,
                        const Tensor& x, const Tensor& d_stream, const Tensor& d_hidden) = 0;
  // Whether f(x) at a position reads x at that position alone (a feed-forward), so that it
  // may run on any subset of a sequence's positions, as incremental decoding runs it (NOTE
  // [Incremental decoding] in incremental_decoder.h).
  virtual bool position_wise() const { return false; }
  // A loss the component adds to the training loss, from the forward just run (over all
  // blocks); its gradient enters the backward that follows with `gradient_weight` (the
  // weight the decoder gives the micro-batch's mean cross-entropy). 0 for most components
  // (NOTE [MoE balancing loss] in moe_feed_forward.h).
  virtual double auxiliary_loss(double gradient_weight) { return 0.0; }
  // The pooled balancing loss under pipeline parallelism (NOTE [Pooled balancing loss
  // across stages] in moe_feed_forward.h), for a component whose balancing loss pools every
  // block's routing; no-ops for any other. The decoder of a stage that does not hold the
  // whole model calls pool_balancing_across_stages once, after which auxiliary_loss leaves
  // the pooled loss out; after each forward add_pooled_statistics adds the component's
  // blocks' statistics (moe_add_balancing_statistics, in block order) to the running sums of
  // the stages before; before the backward set_pooled_balance gives its routers the
  // gradient of the pooled loss of the whole model's statistics, weighted as auxiliary_loss's.
  virtual void pool_balancing_across_stages() {}
  virtual void add_pooled_statistics(std::vector<double>& statistics) const {}
  virtual void set_pooled_balance(const std::vector<double>& statistics, double gradient_weight) {}
  // A Mixture-of-Experts component's routing in block `layer`'s last forward: the
  // assignments each expert kept (tokens × top-k in all unless it drops tokens: NOTE [MoE
  // capacity] in ops/moe.h); empty for any other component.
  virtual std::vector<int64_t> expert_load(int layer) const { return {}; }
};

}  // namespace forge
