// The decoder language model (Llama family) with an explicit forward and backward.
//
//   tokens → embedding → [ block: component → component → ... ] × L
//          → final rmsnorm → output projection + cross-entropy (in token chunks)
//
// Each block is a sequence of residual components (NOTE [Composed blocks]; for Llama
// self-attention then a SwiGLU feed-forward) chosen from ModelConfig. There is no
// autograd: forward_backward() keeps what each component's backward needs in activation
// buffers planned once for (micro_batch, seq_len) in one arena (NOTE [Activation arena]),
// then walks the blocks in reverse — recomputing what activation checkpointing dropped
// (NOTE [Activation checkpointing]) — handing each block's weight gradients to the
// GradSink as soon as they are complete. The model never knows where weights come from or
// where gradients go (ParamSource / GradSink), which keeps it free of communication.
//
// NOTE [Model families]
// A model family is a model of its own built from the shared pieces: the ops (ops/),
// linear layers with their weight descriptors (ops/linear.h), the activation arena and
// checkpointing modes (model/activations.h), weights through ParamSource / GradSink
// (model/parameters.h). DecoderLM is the decoder-LM family (tokens in, next-token loss
// out; ModelConfig is its configuration); a diffusion transformer (FLUX) will be a sibling
// class with its own config, blocks and batch, not a mode of this one.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/block_components.h"
#include "model/config.h"
#include "model/context_parallel.h"
#include "model/parameters.h"
#include "model/pipeline_stage.h"
#include "model/tensor_parallel.h"

namespace forge {

struct LossSum {
  // Sum of per-token cross-entropy (nats) over unmasked targets; in training, plus the
  // auxiliary losses x tokens (NOTE [MoE balancing loss] in model/moe_feed_forward.h)
  double sum = 0.0;
  int64_t tokens = 0;   // number of unmasked targets
  double mean() const { return tokens ? sum / static_cast<double>(tokens) : 0.0; }
};

// The decoder's own buffers around its blocks' components: the residual stream between
// components, the head's, and the backward scratch every component shares. N is the
// rank's tokens (the micro-batch's, or 1/C of them under context parallelism of degree C),
// R the residual stream's rows: N, or N / T under tensor parallelism of degree T.
struct DecoderActivations {
  // stream[i][c]: the residual stream entering component c of block i, [N, H]. c = 0 is
  // the block input, kept per layer in every mode; the others are kept per layer unless
  // checkpointing is full, where one shared set is recomputed.
  std::vector<std::vector<Tensor>> stream;
  Tensor final_input, final_rstd, final_normed;
  Tensor logits_chunk, losses;
  Tensor d_stream;  // the residual stream's gradient, [R, H]
  Tensor d_hidden;  // scratch for a component's normalized-input gradient, and the head's, [R, H]
  // Tensor parallelism (NOTE [Tensor parallelism] in model/tensor_parallel.h), each [N, H]:
  // every rank's rows of the final norm's output (the head's input) and of the stream's
  // gradient (the embedding's backward); the embedding's partial lookup and the head's
  // partial input gradient. Then the vocabulary-parallel cross-entropy's statistics of a
  // chunk, fp32: the row maximum [rows] and the sums (2 rows, flat); the rank's share of the
  // final norm's gradient, [H] fp32.
  Tensor gathered, d_gathered;
  Tensor row_max, ce_sums, norm_grad;
  // Context parallelism (NOTE [Context parallelism] in model/context_parallel.h): the rank's
  // token ids and targets, int32 [N]; its loss sum, [1] fp32, summed over the group.
  Tensor local_tokens, local_targets, loss_sum;
};

// Bytes of the activation arena of a (micro_batch, seq_len) step in compute dtype `dtype`
// under `mode`, with the config's block components.
// expert_parallel: the expert-parallel degree (a rank's received rows grow with it);
// tensor_parallel and context_parallel: the tensor- and context-parallel degrees (a rank's
// share of the activations); rotate: the context-parallel attention's method (the ring's
// scratch is not the all-gather's).
int64_t activation_bytes(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, DType dtype,
                         ActivationCheckpoint mode, int64_t expert_parallel = 1, int64_t tensor_parallel = 1,
                         int64_t context_parallel = 1, PipelineStage stage = {},
                         ContextParallelRotate rotate = ContextParallelRotate::AllGather);

class DecoderLM {
 public:
  // Activations live on `device` in compute_dtype (fp32 on the CPU, bf16 on CUDA), with
  // fp32 statistics (NOTE [Op placement]); the weights handed in must match.
  // `experts`: under expert parallelism (NOTE [Expert parallelism] in
  // model/expert_dispatch.h) how the MoE blocks reach the other ranks' experts; it outlives
  // the model, and the weights handed in then hold this rank's local experts only.
  // `tensor_parallel`: under tensor parallelism (NOTE [Tensor parallelism] in
  // model/tensor_parallel.h) this rank's group; it outlives the model, every rank of the
  // group passes the same tokens and targets, and the weights handed in are this rank's
  // shards (parameter_specs(config, shard)). The losses are every token's on each rank.
  // `context_parallel`: under context parallelism (NOTE [Context parallelism] in
  // model/context_parallel.h) this rank's group; it outlives the model, every rank of the
  // group passes the same tokens and targets, the model computes on the rank's chunks of
  // them, and the loss returned is the micro-batch's on each rank; the weight gradients
  // are the rank's tokens' share, which the group's ranks' sum to the micro-batch's.
  // `stage`: under pipeline parallelism the blocks (and ends) this model computes (NOTE
  // [Pipeline stages] in model/pipeline_stage.h); the default is the whole model.
  DecoderLM(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device = Device::CPU,
            DType compute_dtype = DType::F32, ActivationCheckpoint checkpoint = ActivationCheckpoint::None,
            ExpertDispatch* experts = nullptr, TensorParallel* tensor_parallel = nullptr,
            ContextParallel* context_parallel = nullptr, PipelineStage stage = {});
  // With the blocks' components given instead of chosen from the config: they must declare
  // the parameters parameter_specs(config) lists for a block, in that order.
  DecoderLM(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device, DType compute_dtype,
            ActivationCheckpoint checkpoint, BlockComponents components, ExpertDispatch* experts = nullptr,
            TensorParallel* tensor_parallel = nullptr, ContextParallel* context_parallel = nullptr,
            PipelineStage stage = {});

  const ModelConfig& config() const { return config_; }
  int64_t micro_batch() const { return micro_batch_; }
  int64_t seq_len() const { return seq_len_; }

  Device device() const { return device_; }
  ActivationCheckpoint checkpoint() const { return checkpoint_; }
  int64_t arena_bytes() const { return arena_.nbytes(); }

  // Loss of one micro-batch (tokens/targets int32 [micro_batch, seq_len] on the model's
  // device), and weight gradients of grad_scale * (sum of token losses) into grads
  // (written over fresh buffers, else added: NOTE [Fresh gradient buffers]). `layout`: the
  // examples packed into the rows, on the host (NOTE [Packed examples]); null: each row is
  // one sequence with positions 0, 1, ...
  LossSum forward_backward(const Tensor& tokens, const Tensor& targets, ParamSource& weights, GradSink& grads,
                           float grad_scale, const SequenceLayout* layout = nullptr);
  // NOTE [Pipeline stages]: one stage's half of forward_backward (forward_backward is
  // stage_forward then stage_backward). `tokens` are read by the first stage, `targets` by
  // the last; `grads` null: no gradients (evaluation), and no stage_backward follows.
  LossSum stage_forward(const Tensor& tokens, const Tensor& targets, ParamSource& weights, GradSink* grads,
                        float grad_scale, const SequenceLayout* layout = nullptr);
  void stage_backward(const Tensor& tokens, ParamSource& weights, GradSink& grads);
  const PipelineStage& stage() const { return stage_; }
  const Tensor& stage_input() const { return b_.stream[0][0]; }
  const Tensor& stage_output() const { return b_.final_input; }
  const Tensor& stage_output_grad() const { return b_.d_stream; }
  const Tensor& stage_input_grad() const { return b_.d_stream; }
  // NOTE [Pooled balancing loss across stages] in model/moe_feed_forward.h: whether the
  // stage's training forward and backward carry the pooled balancing loss's statistics
  // (a Mixture-of-Experts model with router_aux_loss_type pooled, on a stage that does not
  // hold the whole model), and the buffers they cross in, I64 [2 num_experts + 1] on the
  // model's device (the doubles' bits): the statistics of the blocks before the stage
  // (received with stage_input), the running sums after its blocks (sent with
  // stage_output), and the whole model's (the last stage's sums: sent with
  // stage_input_grad, received with stage_output_grad).
  bool carries_balance_statistics() const { return pooled_across_stages_; }
  const Tensor& stage_input_statistics() const { return statistics_in_; }
  const Tensor& stage_output_statistics() const { return statistics_out_; }
  const Tensor& pooled_statistics() const { return statistics_pooled_; }

  // Loss only (evaluation).
  LossSum forward_loss(const Tensor& tokens, const Tensor& targets, ParamSource& weights,
                       const SequenceLayout* layout = nullptr);
  // Full logits [micro_batch * seq_len, vocab] in the compute dtype (tests and small-model
  // inspection; not under tensor or context parallelism, where no rank holds them).
  void forward_logits(const Tensor& tokens, ParamSource& weights, const Tensor& logits,
                      const SequenceLayout* layout = nullptr);
  // A Mixture-of-Experts model's routing in the last forward: per block, the assignments
  // each expert received (NOTE [MoE feed-forward]); empty for a dense model.
  std::vector<std::vector<int64_t>> expert_load() const;
  // Under data parallelism, how the MoE blocks sum counts over the ranks, for Megatron's
  // global balancing loss (NOTE [MoE balancing loss] in model/moe_feed_forward.h; every
  // rank's forward_backward then reduces with the others); null: one rank. It outlives the
  // model.
  void set_data_parallel_counts(DataParallelCounts* counts);
  // A new optimizer step: the global balancing loss's counts start over (Megatron's
  // reset_global_aux_loss_tracker). Until the first call every forward_backward since the
  // model was made counts as one step's micro-batch.
  void begin_step();
  // Makes this model keep the step state of its components (the global balancing loss's
  // counts) in `owner`'s, a model of the same config and stage: a pipeline stage's models
  // of its micro-batches in flight count one step together (NOTE [Global balancing loss
  // across stages] in model/moe_feed_forward.h). The state is shared: either model may go first.
  void share_step_state(DecoderLM& owner);

 private:
  // Component c's entries of block i's weights (NOTE [Block weights]).
  ComponentWeights component_weights(int i, const BlockWeights& block, size_t c) const;
  // Where component c of block i writes its output: the next component's stream entry,
  // the next block's input, or the final norm's input.
  const Tensor& component_output(int i, size_t c) const;
  // The stage's embedding (or its input), blocks and final norm.
  void forward_blocks(const Tensor& tokens, ParamSource& weights, const SequenceLayout* layout);
  // One block's forward. With `to_output` false the last component runs without its
  // output (recomputation for the backward needs everything before its last projection).
  void forward_block(int i, const BlockWeights& w, bool to_output);
  // Restores what the checkpointing mode dropped from block i's activations.
  void recompute_block(int i, const BlockWeights& w);
  LossSum output_head(const Tensor& targets, ParamSource& weights, GradSink* grads, float grad_scale);
  // NOTE [Pooled balancing loss across stages]: after a training forward, the stage's blocks'
  // statistics added to the stages' before; on the last stage the routers' gradient and the
  // loss (the coefficient x the pooled loss) it returns, 0 elsewhere.
  double pooled_balance_forward(double gradient_weight);
  void backward_blocks(const Tensor& tokens, ParamSource& weights, GradSink& grads);
  // The head's cross-entropy of one chunk of logits (dlogits in place when `grads`).
  void chunk_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets, bool grads,
                           float grad_scale);
  int64_t vocab_begin() const;  // the rank's first vocabulary row (0 without tensor parallelism)
  // The token ids (targets) the rank computes on, [N]: the micro-batch's, or its chunks
  // of them under context parallelism (taken into the arena).
  Tensor rank_tokens(const Tensor& tokens, const Tensor& local);
  // Under context parallelism, the micro-batch's loss from the rank's `local` one.
  LossSum micro_batch_loss(const LossSum& local, const Tensor& targets);

  ModelConfig config_;
  int64_t micro_batch_, seq_len_, tokens_;
  TensorParallel* tp_ = nullptr;   // null without tensor parallelism
  ContextParallel* cp_ = nullptr;  // null without context parallelism
  PipelineStage stage_;            // resolved: end_layer >= 0
  int layers_;                     // the stage's blocks, end_layer - first_layer
  int64_t rank_tokens_;            // the tokens the rank computes on: tokens_, or tokens_ / C
  Device device_;
  DType compute_dtype_;
  ActivationCheckpoint checkpoint_;
  BlockComponents components_;
  // Per block, per component: its first entry in BlockWeights; then the block's count
  // (blocks differ where a component does: SplitByLayer).
  std::vector<std::vector<size_t>> first_param_;
  Tensor arena_;  // owns the memory every activation buffer views
  DecoderActivations b_;
  bool pooled_across_stages_ = false;  // NOTE [Pooled balancing loss across stages]
  Tensor statistics_in_, statistics_out_, statistics_pooled_;
  double pooled_weight_ = 0.0;  // the last training forward's gradient weight
};

}  // namespace forge
