// Pipeline parallelism in the model: a rank's stages of the decoder, run through a step's
// micro-batches by a schedule, with the stage boundaries crossed through PipelineParallel.
//
// NOTE [Pipeline parallelism]
// The P ranks of a pipeline group hold V model chunks each: chunk v of rank r is virtual
// stage s = v·P + r of the P·V stages, each an equal run of consecutive blocks (NOTE
// [Pipeline stages] in model/pipeline_stage.h), stage 0 with the embedding, stage P·V − 1
// with the final norm and head. V = 1 is the 1F1B schedule, V ≥ 2 the interleaved one
// (NOTE [Pipeline schedules] in model/pipeline_schedule.h). A step's M micro-batches (the
// gradient accumulation's) go through the schedule: each rank walks its list of forwards,
// backwards and exchanges. An exchange is one call of PipelineParallel::exchange that every
// rank of the group makes together, in which a rank sends the stage outputs it made since
// the last one (activations to the next stage's rank, input gradients to the previous
// one's) and receives those it will consume next, straight into the buffers of the stage
// models that consume them.
// Activations: a micro-batch in flight on a chunk has a DecoderLM (an arena) of its own
// from the exchange that brings its input (or, on stage 0, its forward) until the exchange
// that takes its input gradient away (or, on stage 0, its backward). PipelineModel counts
// from the rank's schedule how many a chunk ever holds at once and builds that many. Under
// 1F1B rank 0 holds min(P, M) micro-batches of its L/P blocks, as many activations as one
// rank without pipelining, and rank r > 0 min(P − r + 1, M) (its next input arrives in the
// round before its backward sends the last one's gradient); the memory pipelining saves is
// the other stages' weights, gradients and optimizer state.
// Gradients go to the GradSink as each stage's backward makes them (a chunk's blocks in
// reverse, micro-batch after micro-batch); weights come from the ParamSource, which needs
// to hold only the rank's stages' parameters. The step's loss is on the rank of the last
// stage; the others return an empty LossSum, so a sum over the group is the step's.
// The model makes no communication call itself: PipelineParallel is the trainer's, over
// ProcessGroup::send_recv (distributed/pipeline_parallel_group.h).
//
// NOTE [Expert parallelism under pipeline parallelism]
// With parallelism.expert_parallel_degree E > 1 under pipeline parallelism, the ranks of
// one pipeline rank (a stage's D data-parallel shard ranks, rank = p·D + d: NOTE [Device
// mesh] in train/trainer.cpp; Mixture-of-Experts models take no tensor or context
// parallelism) form D/E expert-parallel groups of E consecutive shard ranks, as DeepSeek-V3
// and Megatron-LM put EP inside the data-parallel ranks of a pipeline stage. Every MoE
// block of every chunk's models dispatches and combines over that group (NOTE [Expert
// parallelism] in model/expert_dispatch.h): each DecoderLM the PipelineModel builds is
// handed the same ExpertDispatch. The all-to-alls line up without a schedule of their own:
// the ranks of a group hold the same stages and walk the same schedule (the same
// forwards, backwards and exchanges of the same micro-batches, in the same order; only the
// tokens differ), so their k-th dispatch is the same block of the same micro-batch's
// forward or backward (or activation recomputation) on every one of them. A pipeline
// exchange pairs a rank with the ranks of the same shard index on the neighbouring stages,
// whose groups are in the same place of the same schedule, so the two kinds of collective
// cannot wait on each other in a cycle; a stage without MoE blocks (DeepSeek's dense first
// blocks) dispatches nothing on every rank of its group alike. Each micro-batch's model
// keeps its own forward counts for its backward, so the interleaved micro-batches never
// share them.
// The weights: FSDP (over the pipeline rank's stages: NOTE [FSDP] and NOTE [ZeRO-2 and -3
// under pipeline parallelism] in distributed/fsdp.h) lays the stages' expert stacks out
// in expert parts, each rank's E/D local experts sharded over the stage's D/E ranks that
// hold the same experts, whose gradients alone they sum; the other weights are sharded and
// summed over the stage's D ranks as without experts. A checkpoint holds every parameter at its place in the whole
// model (each rank writes its segments: the expert slices at their experts' offsets), so it
// loads under any other layout, one rank included. The expert loads are each rank's
// tokens': summed over the data-parallel ranks, then the pipeline group (NOTE [Pipeline
// stages]), they are the whole model's for the routing bias update. LoRA (the frozen base
// laid out the same way, the adapters whole on every rank): NOTE [LoRA under pipeline and
// expert parallelism] in model/lora.h.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "model/decoder_lm.h"
#include "model/expert_dispatch.h"
#include "model/pipeline_schedule.h"
#include "model/pipeline_stage.h"

namespace forge {

class PipelineParallel {
 public:
  struct Transfer {
    bool send;     // false: receive into `tensor`
    int peer;      // the other rank of the pipeline group
    Tensor tensor;
  };
  virtual ~PipelineParallel() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;  // P
  // One round of the schedule: every rank of the group calls it together (NOTE [Pipeline
  // schedules]); each send is matched, in order, by its peer's receive in the same round.
  virtual void exchange(const std::vector<Transfer>& transfers) = 0;
};

// Fails with the reason when the model cannot be cut into `stages` x `virtual_stages`
// equal stages: the blocks must divide evenly, a tied output projection would be on two
// ranks (NOTE [Pipeline stages]).
void check_pipeline_parallel(const ModelConfig& config, int64_t stages, int64_t virtual_stages);
// The chunks per rank (V) of stages of `layers_per_stage` blocks on `stages` ranks; 0
// blocks per stage: V = 1 for 1F1B, 2 for the interleaved schedule. Not checked: see
// check_pipeline_parallel.
int64_t pipeline_virtual_stages(const ModelConfig& config, int64_t stages, int64_t layers_per_stage,
                                PipelineScheduleKind kind);
// Chunk `chunk` of pipeline rank `rank`: virtual stage chunk·P + rank.
PipelineStage pipeline_stage(const ModelConfig& config, int stages, int virtual_stages, int rank, int chunk);

// How many micro-batches chunk `chunk` of pipeline rank `rank` holds at once under
// `schedule`: from the exchange that brings a micro-batch's input (stage 0: its forward) to
// the exchange that sends its input gradient (stage 0: its backward). At least 1.
int pipeline_chunk_in_flight(const PipelineSchedule& schedule, int rank, int chunk);

// One micro-batch as a stage reads it: tokens (first stage), targets (last stage), int32
// [micro_batch, seq_len] on the model's device; the examples packed into its rows, on the
// host, or null.
struct PipelineMicroBatch {
  Tensor tokens, targets;
  const SequenceLayout* layout = nullptr;
};

class PipelineModel {
 public:
  // The rank's chunks of the model for `shape.micro_batches` micro-batches per step; the
  // other arguments as DecoderLM's. `pipeline` (and the tensor- and context-parallel
  // groups, and `experts`) outlive the model. `experts`: the expert-parallel group of the
  // pipeline rank's data-parallel ranks, which every stage's MoE blocks dispatch over
  // (NOTE [Expert parallelism under pipeline parallelism]); null without it.
  PipelineModel(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device, DType compute_dtype,
                ActivationCheckpoint checkpoint, PipelineParallel& pipeline, PipelineScheduleKind kind,
                const PipelineShape& shape, TensorParallel* tensor_parallel = nullptr,
                ContextParallel* context_parallel = nullptr, ExpertDispatch* experts = nullptr);

  // Under data parallelism, how the MoE blocks of every stage model sum counts over the
  // stage's data-parallel ranks (the global balancing loss: NOTE [Global balancing loss
  // across stages] in model/moe_feed_forward.h); null: one rank. It outlives the model.
  void set_data_parallel_counts(DataParallelCounts* counts);

  // One step: every micro-batch's forward and backward through the schedule; gradients of
  // grad_scale x (sum of token losses) into `grads` (NOTE [Fresh gradient buffers]).
  // Returns the loss on the last stage's rank, an empty LossSum elsewhere. The step's
  // state starts over (the global balancing loss's counts, as DecoderLM::begin_step).
  // `before_micro_batch`: called with a micro-batch's index before each of its forwards and
  // backwards on this rank, whose order the schedule interleaves (LoRA's dropout masks are
  // drawn per micro-batch: NOTE [LoRA under pipeline parallelism] in model/lora.h).
  LossSum forward_backward(const std::vector<PipelineMicroBatch>& micro_batches, ParamSource& weights,
                           GradSink& grads, float grad_scale,
                           const std::function<void(int micro_batch)>& before_micro_batch = {});
  // One micro-batch's loss (evaluation): its forward through every stage in turn, one
  // exchange between consecutive stages. On the last stage's rank; empty elsewhere.
  LossSum forward_loss(const PipelineMicroBatch& micro_batch, ParamSource& weights);

  const PipelineSchedule& schedule() const { return schedule_; }
  const PipelineShape& shape() const { return shape_; }
  // The stages of this rank's chunks, in chunk order.
  std::vector<PipelineStage> stages() const;
  // Every stage model's arena: the rank's activation memory.
  int64_t arena_bytes() const;
  // The stage models (micro-batches whose activations the rank can hold at once, over its chunks).
  int in_flight() const;
  // The last forward_backward's loss of each micro-batch over the rank's chunks (off the last
  // stage empty, or a Mixture-of-Experts stage's auxiliary losses: NOTE [Pipeline stages]).
  const std::vector<LossSum>& micro_batch_losses() const { return micro_losses_; }
  // A Mixture-of-Experts model: the last forward_backward's assignments per expert of every
  // MoE block of the model (DecoderLM::expert_load's order), summed over the micro-batches;
  // the blocks of other ranks' stages are zeros, so the sum over the pipeline group is the
  // whole model's (NOTE [Pipeline stages]). Empty for a dense model.
  const std::vector<std::vector<int64_t>>& expert_load() const { return expert_load_; }

 private:
  struct Chunk {
    PipelineStage stage;
    std::vector<std::unique_ptr<DecoderLM>> models;  // one per micro-batch in flight
    std::vector<int> slot_of;                        // per micro-batch: its model, or -1
    std::vector<int> free;                           // models not in use
  };
  int take_slot(Chunk& chunk, int micro_batch);
  static void release_slot(Chunk& chunk, int micro_batch);
  DecoderLM& model_of(int chunk, int micro_batch);
  void exchange(const std::vector<PipelineTransfer>& transfers);

  PipelineParallel& pipeline_;
  PipelineShape shape_;
  PipelineSchedule schedule_;
  std::vector<Chunk> chunks_;
  std::vector<LossSum> micro_losses_;
  int first_moe_layer_ = 0;  // the model's first Mixture-of-Experts block
  std::vector<std::vector<int64_t>> expert_load_;
};

}  // namespace forge
