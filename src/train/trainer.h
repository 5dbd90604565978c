// Trainer: the step loop.
//
//   for each optimizer step:
//     lr from the schedule; zero grads
//     for each of gradient_accumulation_steps micro-batches:
//       forward + backward, loss scaled by 1 / (unmasked targets in the global batch)
//     clip by global grad norm; AdamW; metrics; periodic evaluation
//
// NOTE [Loss normalization]
// The loss of a step is the mean over every unmasked target token of the global batch,
// not the mean of per-micro-batch means, so masking and accumulation do not change what
// is being minimized. The trainer counts the targets of all micro-batches first and
// passes 1/count as the gradient scale.
//
// NOTE [Data-parallel steps]
// With more than one data-parallel rank (parallelism.data_parallel_shard_degree ×
// data_parallel_replicate_degree, equal to the launcher's world size) the model state is
// sharded by FSDP (distributed/fsdp.h; under LoRA the frozen base alone, NOTE [LoRA under
// data parallelism] in trainer.cpp) and every rank computes a slice of the global batch. For
// its a-th accumulation step rank r reads micro-batch a * world + r of the global batch,
// in the order a single device would read it, and nothing else (DataLoader's rank and
// world), so reading does not grow with the world size; the ranks add up their unmasked
// targets exactly (Fsdp::count_over_ranks, NOTE [Loss normalization]): the global batch,
// the loss and the gradients mean the same thing at any world size. Rank 0 alone writes the run directory
// (metrics, TensorBoard, config) and logs; the other ranks only warn.
//
// NOTE [Exact resume]
// A checkpoint at step k holds everything the loop reads that changes from step to step:
// parameters, AdamW m, v and step count, and the data loader position. The LR comes from
// the schedule at the step, evaluation uses its own fresh loader, and nothing else draws
// random numbers, so a run resumed at step k computes bitwise the losses the
// uninterrupted run computes (on the CPU path, whose kernels fix their summation order).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/checkpoint_stream.h"
#include "ckpt/hf_export.h"
#include "data/dataset.h"
#include "distributed/fsdp.h"
#include "distributed/process_group.h"
#include "model/parameters.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model/nf4_base.h"
#include "model/context_parallel.h"
#include "model/pipeline.h"
#include "model/tensor_parallel.h"
#include "optim/optimizer.h"
#include "train/experiment.h"
#include "train/loss_spike.h"
#include "train/metrics.h"
#include "train/nonfinite.h"
#include "train/training_observer.h"

namespace forge {

// The model's view of a batch's examples (NOTE [Example batches] in data/dataset.h);
// passed to the model only when batch.has_examples().
inline SequenceLayout sequence_layout(const Batch& batch) { return {batch.positions, batch.segments}; }

struct CheckpointSaveJob;

struct TrainResult {
  std::vector<double> losses;       // per optimizer step
  std::vector<double> step_seconds; // per optimizer step, wall time
  std::vector<EvalMetrics> evals;
  double entropy_floor = -1.0;      // of the training data, when known
  std::string run_dir;
  bool stopped = false;             // by SIGTERM/SIGINT before training.steps (NOTE [Stop signals])
  bool stopped_by_observer = false; // the TrainingObserver ended training after an evaluation
  int64_t loss_spikes = 0;          // NOTE [Loss spikes]: in this process
};

// The process group settings an experiment asks for (device, parallelism timeouts).
ProcessGroupOptions process_group_options(const ExperimentConfig& config);
// The device an experiment computes on (training.device), checked against the build, the
// GPUs visible and precision.compute_dtype (NOTE [Op placement]).
Device compute_device(const ExperimentConfig& config);
// The seed make_dataset draws the experiment's data with (training.seed's data stream):
// forge eval reads the validation data forge train evaluates on.
uint64_t dataset_seed(const TrainingConfig& training);

class Trainer {
 public:
  // resolved_config_yaml is saved as <run_dir>/config.yaml.
  // world: the process group of a data-parallel run, when the caller keeps one across
  // several trainers (forge bench's sweeps); null: the trainer makes its own if needed.
  Trainer(const ExperimentConfig& config, std::string resolved_config_yaml, ProcessGroup* world = nullptr);
  ~Trainer();

  TrainResult run();
  // Whether run() draws its progress bar on a terminal (forge bench draws its own, for the
  // whole sweep).
  void show_progress(bool show) { show_progress_ = show; }
  // Hears the step loop and may decide evaluations and an early stop (training_observer.h);
  // not owned, outlives run().
  void set_observer(TrainingObserver* observer) { observer_ = observer; }
  EvalMetrics evaluate(int64_t step);

  // The training data (forge mlperf logs its size).
  const TokenDataset& train_data() const { return *train_data_; }

  // The fp32 weights of single-device training (not available under FSDP, where each
  // rank holds a shard).
  const FlatParameters& parameters() const;

 private:
  void prepare_run_dir();
  double lr_for_step(int64_t step) const;
  // The weights the model computes with: FSDP's, else the bf16 copy on CUDA, else the fp32 weights.
  ParamSource& weights();
  GradSink& gradients();
  // What the optimizer trains on one device: the parameters, or under LoRA the adapters
  // (NOTE [LoRA training]); their gradients, names, and the checkpoint's tensors.
  std::vector<Tensor> trainable_weights() const;
  std::vector<Tensor> trainable_gradients() const;
  std::vector<std::string> trainable_names() const;
  void discard_gradients();
  // The step's gradients start afresh (NOTE [Fresh gradient buffers]) and, under data
  // parallelism, end summed over every rank (FSDP's reductions, or the LoRA adapters'
  // all-reduce: NOTE [LoRA under data parallelism]).
  // NOTE [Routing bias update] in trainer.cpp: after an optimizer step, from the step's loads.
  // chunk_written: under FSDP, the optimizer wrote the compute chunk (NOTE [Routing bias update]).
  void update_routing_biases(const std::vector<std::vector<int64_t>>& expert_load, bool chunk_written);
  void begin_gradients();
  void finish_gradients();
  // NOTE [Tensor-parallel gradient norm]: the whole model's squared gradient norm.
  double tensor_parallel_grad_sum_of_squares();
  // FSDP holds the trainable state (full training under data parallelism; not LoRA).
  bool sharded_gradients() const { return fsdp_ && !lora_; }
  std::vector<ParamSpec> checkpoint_specs() const;
  // LoRA: the adapters in PEFT's format into <run_dir>/adapter (trainer_hf.cpp).
  void save_peft_adapter_to_run_dir();
  // checkpoint.last_save_in_hf under tensor parallelism where the pieces do not serve: the
  // shards gathered into the whole model on rank 0, exported there (trainer_hf.cpp).
  void export_tensor_parallel_hf_model(const std::string& dir, const HfExportOptions& options);
  // QLoRA under expert parallelism (NOTE [NF4 expert stacks under expert parallelism]): the
  // expert stacks gathered to rank 0 from its expert-parallel group, the adapters merged there.
  void export_expert_parallel_qlora_model(const std::string& dir, const HfExportOptions& options);
  // This rank's local experts (NOTE [Expert parallelism]); {0, 1} without expert parallelism.
  ExpertShard expert_shard() const;
  // checkpoint.last_save_in_hf under pipeline parallelism, FSDP or tensor parallelism: every
  // rank writes its own values into the files (NOTE [Export in pieces] in trainer_hf.cpp).
  void export_hf_model_in_pieces(const std::string& dir, const HfExportOptions& options);
  // LoRA under pipeline and data parallelism: the stages' frozen base, whole, on shard rank 0.
  void gather_stage_base(FlatParameters& stages);
  // The process groups of a data-parallel run (several ranks); the Fsdp itself is made
  // after the memory check.
  void set_up_data_parallel();
  void log_fsdp_memory() const;
  void log_fp8() const;  // what precision.fp8 runs in FP8

  // trainer_resume.cpp (NOTE [Choosing the checkpoint to resume])
  std::optional<std::string> choose_checkpoint();
  std::string checkpoint_problem(const std::string& dir);
  // trainer_checkpoint.cpp
  std::string checkpoint_folder() const;
  void restore_checkpoint(const std::string& dir);
  void load_initial_weights(const std::string& path);
  void save_checkpoint(int64_t step);
  // Completes the save in progress, if any (NOTE [Async checkpoints]): waits for its
  // writer, exchanges the CRC-32s and puts the checkpoint into place.
  void finish_checkpoint_save_job();
  size_t checkpoint_buffer_bytes() const;
  // This rank's segments of the parameters and both moments (NOTE [Streaming checkpoints]),
  // in its index space (its shards under tensor parallelism), and those of them it writes.
  std::array<std::vector<FlatSegment>, 3> checkpoint_segments() const;
  std::array<std::vector<FlatSegment>, 3> checkpoint_segments_to_save() const;
  // Under tensor parallelism: where this rank's index space lies in the whole model's.
  std::optional<ShardPlacement> tensor_parallel_placement() const;
  // The collectives of checkpoint saves and resumes, over every rank (null: one rank).
  DataParallelComm* checkpoint_comm() const {
    return world_comm_ ? world_comm_.get() : pipeline_comm_ ? pipeline_comm_.get() : dp_;
  }
  // Reads the weights (and the optimizer state) into place; what it staged, for the log.
  std::string read_checkpoint_state(const Checkpoint& checkpoint, bool with_optimizer);
  // The same into the given segments (a LoRA run's frozen base from a forge checkpoint).
  std::string read_checkpoint_state(const Checkpoint& checkpoint, bool with_optimizer,
                                    const std::array<std::vector<FlatSegment>, 3>& segments);
  // Copies the segments to a snapshot (async saves); false when no memory holds one.
  bool snapshot(CheckpointSaveJob& job, std::array<std::vector<FlatSegment>, 3>& segments);
  // trainer_nonfinite.cpp (NOTE [Non-finite steps])
  void inject_test_nan(int64_t step, int64_t micro_batch);
  // A step whose loss sum or gradient norm is not finite: throws (on_nonfinite stop) naming
  // what was found, or logs the skip and counts it.
  void handle_nonfinite(int64_t step, const std::vector<Batch>& batches, float grad_scale,
                        const std::vector<double>& micro_losses, double loss, double norm,
                        const std::string& fp8_amax);
  std::string first_nonfinite_gradient();  // "" when every gradient is finite
  std::string first_over_pipeline(bool weights);
  [[noreturn]] void handle_nonfinite_pipeline(int64_t step, const std::vector<double>& micro_losses, double loss,
                                              double norm, const std::string& fp8_amax);
  // trainer_fp8.cpp (NOTE [FP8 under data parallelism], NOTE [FP8 under context and pipeline
  // parallelism]): the step's first non-finite FP8 amax named, the same on every rank
  // (`ranks` ranks saw one, this one `own`, maybe none).
  std::string describe_nonfinite_amax(const Fp8Projections::NonfiniteAmax& own, int64_t ranks);
  // The step's amaxes agreed over the ranks (delayed), then Fp8Projections::end_step.
  void end_fp8_step(bool update);
  // A loss spike (NOTE [Loss spikes]): warns, throws (on_loss_spike stop), or counts the
  // skip; true when the step's update is to be skipped.
  bool handle_loss_spike(int64_t step, double loss, const LossSpikeDetector::Verdict& spike);
  // trainer_hf.cpp
  void load_initial_hf_weights(const std::string& dir);
  // Fills every rank's FSDP chunk from the whole model in host memory (the parameters
  // under full training, the frozen base under LoRA).
  void load_fsdp_chunks(const FlatParameters& host);
  void export_hf_model();

  ExperimentConfig config_;
  std::string resolved_yaml_;
  std::string run_dir_;
  std::optional<std::string> resume_from_;  // the checkpoint this run continues, if any
  int64_t start_step_ = 0;                  // optimizer steps already done (resumed runs)
  Device device_ = Device::CPU;
  std::unique_ptr<FlatParameters> params_, grads_, compute_weights_;
  std::unique_ptr<DecoderLM> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<LoraAdapters> lora_;  // lora.rank > 0 (NOTE [LoRA training]); params_ is then the frozen base
  std::unique_ptr<Nf4FrozenBase> nf4_base_;  // QLoRA (NOTE [QLoRA base]): the frozen base instead of params_
  // precision.fp8: wraps the weights and gradients the model is handed (NOTE [FP8 projections]),
  // under LoRA the frozen base beneath lora_ (NOTE [FP8 frozen base])
  std::unique_ptr<Fp8Projections> fp8_;
  std::unique_ptr<TokenDataset> train_data_, eval_data_;
  std::unique_ptr<DataLoader> train_loader_;
  std::unique_ptr<MetricsWriter> metrics_;  // rank 0 only
  bool show_progress_ = true;
  int64_t eval_split_noted_ = 0;  // NOTE [Evaluation under data parallelism]: the note is logged once
  TrainingObserver* observer_ = nullptr;
  // Data parallelism (NOTE [Data-parallel steps]); without it these stay empty. rank_ and
  // world_size_ count every rank; data_rank_ and data_ranks_ the data-parallel ones (the
  // same without tensor parallelism, whose groups read one micro-batch).
  int rank_ = 0, world_size_ = 1;
  int data_rank_ = 0, data_ranks_ = 1;
  std::unique_ptr<ProcessGroup> own_world_, shard_split_, replicate_group_;
  // Tensor parallelism (NOTE [Tensor parallelism] in model/tensor_parallel.h): the
  // consecutive ranks that split every layer, the data-parallel ranks of the same
  // tensor-parallel rank (FSDP's world), the model's collectives over the former and the
  // step's scalars over it.
  std::unique_ptr<ProcessGroup> tensor_parallel_group_, data_parallel_group_;
  // The same ranks as tensor_parallel_group_, for FSDP's FP8 all-gather, whose amax
  // reductions run on FSDP's communication stream (NOTE [FP8 all-gather] in distributed/fsdp.h).
  std::unique_ptr<ProcessGroup> fp8_gather_tensor_parallel_group_;
  std::unique_ptr<TensorParallel> tensor_parallel_;
  std::unique_ptr<DataParallelComm> tensor_parallel_comm_;
  // Under tensor parallelism, the step's data-parallel collectives (dp_) leave out the other
  // tensor-parallel ranks: checkpoints use this one over every rank.
  std::unique_ptr<DataParallelComm> world_comm_;
  TensorParallelShard tensor_parallel_shard_;
  // Context parallelism (NOTE [Context parallelism] in model/context_parallel.h): the ranks
  // of the same tensor-parallel and data-parallel rank that split every sequence, and the
  // model's collectives over them; FSDP's world holds them too (NOTE [Context-parallel
  // steps] in trainer.cpp).
  std::unique_ptr<ProcessGroup> context_parallel_group_;
  std::unique_ptr<ContextParallel> context_parallel_;
  int context_parallel_degree_ = 1;
  // Expert parallelism (NOTE [Expert parallelism]): the consecutive ranks that split the
  // experts, the ranks that hold the same experts, and the model's dispatch over the former.
  std::unique_ptr<ProcessGroup> expert_parallel_group_, expert_shard_group_;
  std::unique_ptr<ExpertDispatch> expert_dispatch_;
  // Pipeline parallelism (NOTE [Pipeline parallelism] in model/pipeline.h): the rank's
  // stages, the model's exchanges over the world (every rank a pipeline rank), the
  // schedule's model in place of model_, and the step's scalars over the pipeline.
  std::vector<PipelineStage> pipeline_stages_;
  std::unique_ptr<ProcessGroup> pipeline_group_;  // null when every rank is a pipeline rank (the world)
  std::unique_ptr<ProcessGroup> stage_group_;     // the ranks of this rank's stage, when more than one and not all
  std::unique_ptr<PipelineParallel> pipeline_;
  std::unique_ptr<PipelineModel> pipeline_model_;
  std::unique_ptr<DataParallelComm> pipeline_comm_;
  ProcessGroup* world_ = nullptr;
  ProcessGroup* shard_group_ = nullptr;
  std::unique_ptr<Fsdp> fsdp_;
  // QLoRA under data parallelism: the collectives alone (its NF4 base is replicated).
  std::unique_ptr<DataParallelComm> replicated_comm_;
  DataParallelComm* dp_ = nullptr;  // fsdp_ or replicated_comm_: the step's collectives
  std::unique_ptr<CheckpointSaveJob> checkpoint_job_;  // a save not yet complete
  std::optional<NanInjection> inject_nan_;  // FORGE_TEST_INJECT_NAN
  int64_t skipped_in_a_row_ = 0, skipped_steps_ = 0;
  LossSpikeDetector loss_spike_{0, 1};     // NOTE [Loss spikes]: set from the config in the constructor
  std::vector<int64_t> loss_spike_steps_;  // the spikes of this process
  std::vector<LossScaling> scale_loss_;    // FORGE_TEST_SCALE_LOSS
  bool earlier_run_ = false;     // the run directory held metrics.jsonl at start
  bool hf_export_done_ = false;  // checkpoint.last_save_in_hf: a finished run's export is there
};

}  // namespace forge
