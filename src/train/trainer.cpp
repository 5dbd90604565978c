#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <optional>
#include <tuple>

#include <string.h>
#include <unistd.h>

#include "ckpt/checkpoint.h"
#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "ckpt/peft_adapter.h"
#include "train/checkpoint_save_job.h"
#include "core/device.h"
#include "core/durable_file.h"
#include "core/log.h"
#include "core/op_profile.h"
#include "core/parallel.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/stop_signal.h"
#include "distributed/expert_dispatch_group.h"
#include "distributed/heartbeat.h"
#include "distributed/context_parallel_group.h"
#include "distributed/pipeline_parallel_group.h"
#include "distributed/tensor_parallel_group.h"
#include "model/lora.h"
#include "ops/elementwise.h"
#include "ops/matmul.h"
#include "ops/moe.h"
#include "train/memory_check.h"
#include "train/restart_log.h"
#include "train/run_dir.h"

namespace forge {
namespace {

// A Mixture-of-Experts step's per-block expert loads summed over the ranks of `group`.
std::vector<std::vector<int64_t>> loads_over_ranks(const std::vector<std::vector<int64_t>>& load,
                                                   DataParallelComm& group) {
  std::vector<int64_t> flat;
  for (const std::vector<int64_t>& block : load) flat.insert(flat.end(), block.begin(), block.end());
  flat = group.counts_over_ranks(flat);
  std::vector<std::vector<int64_t>> total = load;
  size_t next = 0;
  for (std::vector<int64_t>& block : total)
    for (int64_t& n : block) n = flat[next++];
  return total;
}

// Adds one micro-batch's expert load (per block, per expert) into the step's.
void add_expert_load(std::vector<std::vector<int64_t>>& total, const std::vector<std::vector<int64_t>>& load) {
  if (total.empty()) total.assign(load.size(), {});
  for (size_t i = 0; i < load.size(); ++i) {
    if (total[i].empty()) total[i].assign(load[i].size(), 0);
    for (size_t e = 0; e < load[i].size(); ++e) total[i][e] += load[i][e];
  }
}

// The share of a step's assignments dropped (NOTE [MoE capacity] in ops/moe.h): the loads
// count the kept ones, and every block routed `assignments` (the step's tokens x top-k).
double dropped_share(const std::vector<std::vector<int64_t>>& load, double assignments) {
  double kept = 0.0;
  for (const std::vector<int64_t>& block : load)
    for (int64_t n : block) kept += static_cast<double>(n);
  const double all = assignments * static_cast<double>(load.size());
  return all > 0 ? 1.0 - kept / all : 0.0;
}

#ifdef FORGE_CUDA
constexpr bool kCudaBuilt = true;
#else
constexpr bool kCudaBuilt = false;
#endif

enum SeedStream : uint64_t { kWeightsSeed = 1, kDataSeed = 2, kOrderSeed = 3, kLoraSeed = 4, kLoraDropoutSeed = 5 };

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The seed of a micro-batch's LoRA dropout masks (NOTE [LoRA dropout] in ops/lora.h): the
// run's, and under context parallelism each rank's own, so that the ranks' chunks of a
// sequence are not dropped alike (NOTE [LoRA under context and tensor parallelism] in
// model/lora.h).
uint64_t lora_dropout_seed(uint64_t run_seed, const ContextParallel* context_parallel) {
  const uint64_t seed = derive_seed(run_seed, kLoraDropoutSeed);
  return context_parallel ? derive_seed(seed, 1 + static_cast<uint64_t>(context_parallel->rank())) : seed;
}

std::string human_count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f} M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f} K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

}  // namespace

Trainer::Trainer(const ExperimentConfig& config, std::string resolved_config_yaml, ProcessGroup* world)
    : config_(config), resolved_yaml_(std::move(resolved_config_yaml)), world_(world) {
  const TrainingConfig& t = config_.training;
  device_ = compute_device(config_);
  // Before anything touches the GPU: the NCCL group makes GPU local_rank this process's device.
  set_up_data_parallel();

  // Before the first large allocation (the FSDP buffers): the estimate is checked against
  // what the GPU has free, so nothing of this run may be counted as in use already.
  check_memory_fits(config_);
  // NOTE [Context-parallel steps]: FSDP's world holds the context-parallel ranks too.
  const int fsdp_ranks = data_ranks_ * context_parallel_degree_;
  if (fsdp_ranks > 1 && config_.lora.quantize_base == "nf4") {
    // NOTE [LoRA under data parallelism]: the NF4 base is replicated; only the collectives, over
    // the stage's ranks under pipeline parallelism (NOTE [LoRA under pipeline parallelism]),
    // over the ranks with the same shards under tensor parallelism (NOTE [NF4 base under
    // tensor parallelism]: the base replicated over them, split over the tensor-parallel group).
    ProcessGroup& replicas =
        data_parallel_group_ ? *data_parallel_group_ : (stage_group_ ? *stage_group_ : *world_);
    replicated_comm_ = std::make_unique<DataParallelComm>(device_, replicas, nullptr);
    dp_ = replicated_comm_.get();
  } else if (fsdp_ranks > 1) {
    FsdpOptions fsdp;
    fsdp.tensor_parallel = tensor_parallel_shard_;
    fsdp.zero_stage = static_cast<int>(config_.parallelism.zero_stage);
    fsdp.reduce_dtype = config_.precision.reduce_dtype == "bf16" ? DType::BF16 : DType::F32;
    fsdp.frozen = config_.lora.enabled();  // NOTE [LoRA under data parallelism]
    fsdp.expert_parallel = static_cast<int>(config_.parallelism.expert_parallel_degree);
    fsdp.fp8_all_gather = config_.precision.fp8_fsdp_all_gather;  // NOTE [FP8 all-gather]
    fsdp.fp8_output_head = config_.precision.fp8 != "none" && config_.precision.fp8_output_head;
    fsdp.fp8_routed_experts = config_.precision.fp8_routed_experts;  // NOTE [FP8 all-gather pieces]
    fsdp.fp8_filter_fqns = fp8_filter_fqns_of(config_.precision.fp8_filter_fqns);  // NOTE [FP8 filter]
    fsdp.pipeline_stages = pipeline_stages_;  // NOTE [Pipeline parallelism]: FSDP over the rank's stages
    fsdp_ = std::make_unique<Fsdp>(config_.model, device_, *shard_group_, replicate_group_.get(), fsdp,
                                   expert_shard_group_.get());
    dp_ = fsdp_.get();
  }
  const DType compute_dtype = device_ == Device::CUDA ? DType::BF16 : DType::F32;
  std::vector<bool> decay;
  if (config_.lora.enabled()) {
    // NOTE [LoRA under context and tensor parallelism]: the split matrices' shards for the base's.
    lora_ = std::make_unique<LoraAdapters>(config_.model, config_.lora, device_, t.local_batch_size * t.seq_len,
                                           tensor_parallel_shard_);
    lora_->initialize(derive_seed(t.seed, kLoraSeed));
    if (const ExpertShard experts = expert_shard(); experts.size > 1)  // NOTE [LoRA under expert parallelism]
      lora_->set_expert_parallel(experts.index, experts.size);
    if (config_.checkpoint.initial_load_in_hf && !config_.checkpoint.initial_load_path.empty())
      lora_->set_interleaved_rotary(read_weight_layout(config_.checkpoint.initial_load_path).interleaved_rotary);
    if (fsdp_) {
      // NOTE [LoRA under data parallelism]: the frozen base sharded, the adapters replicated.
      fsdp_->initialize(derive_seed(t.seed, kWeightsSeed));
      lora_->set_base(*fsdp_);
      if (config_.precision.fp8 != "none") {
        // NOTE [FP8 frozen base] over the gathered base (NOTE [FP8 under data parallelism]).
        fp8_ = std::make_unique<Fp8Projections>(config_.model, *fp8_settings_of(config_), device_,
                                                t.local_batch_size * t.seq_len);
        fp8_->set_base(*fsdp_);
        // NOTE [FP8 all-gather of a frozen base] in distributed/fsdp.h.
        if (config_.precision.fp8_fsdp_all_gather) fsdp_->set_fp8_projections(*fp8_);
        if (fp8_gather_tensor_parallel_group_) fsdp_->set_fp8_tensor_parallel_group(*fp8_gather_tensor_parallel_group_);
        lora_->set_base(*fp8_);
        log_fp8();
      }
    } else if (config_.lora.quantize_base == "nf4") {
      if (config_.precision.fp8 != "none") {
        // NOTE [FP8 over an NF4 base] in model/nf4_base.cpp: the projections wrap the NF4
        // base once it is built (below, or at the Hugging Face import).
        fp8_ = std::make_unique<Fp8Projections>(config_.model, *fp8_settings_of(config_), device_,
                                                t.local_batch_size * t.seq_len);
        log_fp8();
      }
      // NOTE [QLoRA base]: built from the Hugging Face weights when they are imported;
      // without them, from the seeded initialization, one parameter at a time (a resumed
      // run initializes and quantizes again, to bitwise the same codes).
      const CheckpointConfig& ckpt = config_.checkpoint;
      if (!ckpt.initial_load_in_hf || ckpt.initial_load_path.empty()) {
        // NOTE [LoRA under pipeline parallelism]: a pipeline rank quantizes its stages' alone.
        // NOTE [NF4 expert stacks under expert parallelism]: an expert-parallel rank its experts'.
        // NOTE [NF4 base under tensor parallelism]: a tensor-parallel rank its shards'.
        nf4_base_ = std::make_unique<Nf4FrozenBase>(config_.model, device_, compute_dtype, pipeline_stages_,
                                                    expert_shard(), tensor_parallel_shard_);
        nf4_base_->initialize(derive_seed(t.seed, kWeightsSeed));
        if (fp8_) fp8_->set_base(*nf4_base_);  // NOTE [FP8 over an NF4 base] in model/nf4_base.cpp
        lora_->set_base(fp8_ ? static_cast<ParamSource&>(*fp8_) : *nf4_base_);
        log_info("QLoRA: the base's projections quantized to NF4 from the seeded initialization (no "
                 "checkpoint.initial_load_path); the frozen base holds {:.2f} MiB on {}",
                 static_cast<double>(nf4_base_->nbytes()) / (1024.0 * 1024.0), device_name(device_));
      }
    } else {
      // NOTE [LoRA training]: the frozen base once (the rank's shards under tensor
      // parallelism, its stages' under pipeline parallelism), in the compute dtype; the
      // adapters train.
      params_ = std::make_unique<FlatParameters>(config_.model, device_, compute_dtype, tensor_parallel_shard_,
                                                 pipeline_stages_);
      params_->initialize(derive_seed(t.seed, kWeightsSeed));
      lora_->set_base(*params_);
      if (config_.precision.fp8 != "none") {
        // NOTE [FP8 frozen base]: the base's GEMMs in FP8 under the adapters.
        fp8_ = std::make_unique<Fp8Projections>(config_.model, *fp8_settings_of(config_), device_,
                                                t.local_batch_size * t.seq_len);
        fp8_->set_base(*params_);
        lora_->set_base(*fp8_);
        log_fp8();
      }
    }
    decay.assign(lora_->masters().size(), true);
    optimizer_ = std::make_unique<AdamW>(config_.optimizer, lora_->masters(), decay);
  } else if (fsdp_) {
    fsdp_->initialize(derive_seed(t.seed, kWeightsSeed));
    for (const FsdpSegment& segment : fsdp_->layout().segments()) decay.push_back(segment.weight_decay);
    optimizer_ = std::make_unique<AdamW>(config_.optimizer, fsdp_->master_segments(), decay);
    if (config_.precision.fp8 != "none") {
      // NOTE [FP8 under data parallelism]: the gathered compute weights, quantized per rank
      // (a context-parallel rank's linear calls see 1/C of the micro-batch's tokens).
      fp8_ = std::make_unique<Fp8Projections>(config_.model, *fp8_settings_of(config_), device_,
                                              t.local_batch_size * t.seq_len / context_parallel_degree_);
      fp8_->set_base(*fsdp_, *fsdp_);
      if (config_.precision.fp8_fsdp_all_gather) fsdp_->set_fp8_projections(*fp8_);
      // NOTE [FP8 all-gather]: under tensor parallelism the whole weight's amax, over both groups.
      if (fp8_gather_tensor_parallel_group_) fsdp_->set_fp8_tensor_parallel_group(*fp8_gather_tensor_parallel_group_);
      log_fp8();
    }
  } else {
    // NOTE [Mixed precision]: on CUDA the optimizer owns fp32 master weights and fp32
    // gradients; the model computes with a bf16 copy of the weights refreshed after every
    // optimizer step. On the CPU the fp32 weights are used directly.
    const TensorParallelShard shard = tensor_parallel_shard_;  // NOTE [Tensor-parallel shards]
    // NOTE [Pipeline parallelism]: a pipeline rank holds its stages' parameters alone.
    const std::vector<PipelineStage>& stages = pipeline_stages_;
    params_ = std::make_unique<FlatParameters>(config_.model, device_, DType::F32, shard, stages);
    grads_ = std::make_unique<FlatParameters>(config_.model, device_, DType::F32, shard, stages);
    params_->initialize(derive_seed(t.seed, kWeightsSeed));
    if (device_ == Device::CUDA) {
      compute_weights_ = std::make_unique<FlatParameters>(config_.model, device_, DType::BF16, shard, stages);
      compute_weights_->assign_from(*params_);
    }
    for (const auto& spec : params_->specs()) decay.push_back(spec.weight_decay);
    optimizer_ = std::make_unique<AdamW>(config_.optimizer, params_->tensors(), decay);
    if (config_.precision.fp8 != "none") {
      // NOTE [FP8 projections]: the config allows FP8 here (full training, one device or a
      // pipeline rank's stages: NOTE [FP8 under context and pipeline parallelism]), under FSDP
      // (above) and under LoRA on one device (above).
      fp8_ = std::make_unique<Fp8Projections>(config_.model, *fp8_settings_of(config_), device_,
                                              t.local_batch_size * t.seq_len);
      fp8_->set_base(compute_weights_ ? *compute_weights_ : *params_, *grads_);
      log_fp8();
    }
  }
  // NOTE [FP8 under tensor parallelism]: the shards' amaxes agreed over the group.
  if (fp8_ && tensor_parallel_) fp8_->set_tensor_parallel_group(*tensor_parallel_);
  if (tensor_parallel_)
    log_info("tensor-parallel rank {} of {} (data-parallel rank {} of {}): its heads, feed-forward columns and "
             "vocabulary rows, {} of the model's {} parameters{}",
             tensor_parallel_shard_.rank, tensor_parallel_shard_.size, data_rank_, data_ranks_,
             human_count(static_cast<double>(tensor_parallel_rank_parameters(config_.model, tensor_parallel_shard_.size))),
             human_count(static_cast<double>(config_.model.total_params())),
             tensor_parallel_->async() ? "; async: the blocks' all-gathers and reduce-scatters as ring steps under "
                                         "their GEMMs (NOTE [Async tensor parallelism])"
                                       : "");
  if (dp_) log_fsdp_memory();
  const ActivationCheckpoint checkpointing = activation_checkpoint_from_name(config_.activation_checkpoint.mode);
  if (pipeline_) {
    const ParallelismConfig& p = config_.parallelism;
    const PipelineScheduleKind kind = parse_pipeline_schedule(p.pipeline_parallel_schedule);
    const PipelineShape shape{pipeline_->size(), static_cast<int>(pipeline_stages_.size()),
                              static_cast<int>(t.gradient_accumulation_steps)};
    pipeline_model_ = std::make_unique<PipelineModel>(config_.model, t.local_batch_size, t.seq_len, device_,
                                                      compute_dtype, checkpointing, *pipeline_, kind, shape,
                                                      tensor_parallel_.get(), context_parallel_.get(),
                                                      expert_dispatch_.get());
    // The global balancing loss's counts over the stage's data-parallel ranks (NOTE [Global
    // balancing loss across stages] in model/moe_feed_forward.h).
    if (dp_) pipeline_model_->set_data_parallel_counts(dp_);
    std::string blocks;
    int held = 0;
    int64_t held_params = 0;  // the stages' parameters (a QLoRA base's before it is imported too)
    if (fsdp_) held_params = fsdp_->layout().parameter_count();
    else
      for (const ParamSpec& spec : pipeline_stage_specs(parameter_specs(config_.model, tensor_parallel_shard_),
                                                        pipeline_stages_))
        held_params += shape_numel(spec.shape);
    for (const PipelineStage& s : pipeline_stages_) {
      held += s.end_layer - s.first_layer;
      blocks += (blocks.empty() ? "" : ", ") + (s.end_layer - s.first_layer == 1
                                                    ? std::to_string(s.first_layer)
                                                    : fmt::format("{}-{}", s.first_layer, s.end_layer - 1));
    }
    log_info("pipeline rank {} of {}: block{} {}{}{}, {} of the model's {} parameters; {} (the schedule's idle "
             "share at a backward of two forwards); activations of {} micro-batches in flight over its stages: "
             "{:.2f} MiB",
             pipeline_->rank(), pipeline_->size(), held == 1 ? "" : "s", blocks,
             pipeline_stages_.front().embedding ? " and the embedding" : "",
             pipeline_stages_.back().head ? " and the head" : "", human_count(static_cast<double>(held_params)),
             human_count(static_cast<double>(config_.model.total_params())),
             describe_pipeline_schedule(kind, shape, pipeline_model_->schedule()), pipeline_model_->in_flight(),
             static_cast<double>(pipeline_model_->arena_bytes()) / (1024.0 * 1024.0));
  }
  if (world_size_ > 1 && rank_ != 0) set_log_level(LogLevel::Warn);
  if (!pipeline_) {
    model_ = std::make_unique<DecoderLM>(config_.model, t.local_batch_size, t.seq_len, device_, compute_dtype,
                                         checkpointing, expert_dispatch_.get(), tensor_parallel_.get(),
                                         context_parallel_.get());
    // Megatron's global balancing loss sums each micro-batch's tokens per expert over the
    // data-parallel ranks (NOTE [MoE balancing loss] in model/moe_feed_forward.h).
    if (dp_) model_->set_data_parallel_counts(dp_);
  }

  uint64_t data_seed = dataset_seed(t);
  train_data_ = make_dataset(config_.data, Split::Train, t.seq_len, config_.model.vocab_size, data_seed);
  if (config_.eval.interval > 0)
    eval_data_ = make_dataset(config_.data, Split::Validation, t.seq_len, config_.model.vocab_size, data_seed);
  train_loader_ = std::make_unique<DataLoader>(*train_data_, t.local_batch_size, derive_seed(t.seed, kOrderSeed),
                                               data_rank_, data_ranks_);
  inject_nan_ = nan_injection_from_env();
  if (inject_nan_)
    log_warn("FORGE_TEST_INJECT_NAN: a test hook sets a NaN in the {} of '{}' at step {}, micro-batch {}",
             inject_nan_->fp8_amax ? "FP8 weight amax" : "gradient", inject_nan_->tensor, inject_nan_->step,
             inject_nan_->micro_batch);
  loss_spike_ = LossSpikeDetector(t.loss_spike_factor, t.loss_spike_window);
  scale_loss_ = loss_scalings_from_env();
  for (const LossScaling& s : scale_loss_)
    log_warn("FORGE_TEST_SCALE_LOSS: a test hook multiplies the loss of step {} by {} (the gradients are untouched)",
             s.step, s.factor);
}

void Trainer::log_fp8() const {
  const PrecisionConfig& p = config_.precision;
  log_info("FP8 {}: the {} GEMMs of the {}block projections{} in FP8 (activations and weights e4m3, gradients {}), "
           "the output head in {}{}",
           fp8_recipe_description(p),
           lora_                    ? "forward and input-gradient"
           : p.fp8_weight_gradient  ? "forward and backward"
                                    : "forward and input-gradient (the weight gradients in the compute dtype: "
                                      "precision.fp8_weight_gradient false)",  // NOTE [FP8 weight gradient switch]
           !lora_                                    ? ""
           : config_.lora.quantize_base != "nf4"      ? "frozen base's "
           : device_ == Device::CUDA && config_.model.mla()
               ? "NF4 base's (each cast straight from its NF4 codes, the projections with rotary-ordered rows "
                 "through bf16) "
           : device_ == Device::CUDA                  ? "NF4 base's (each cast straight from its NF4 codes) "
                                                      : "NF4 base's (each dequantized to bf16, then cast) ",
           !config_.model.moe()      ? ""
           : p.fp8_routed_experts    ? " and routed experts"
                                     : " (the routed experts in the compute dtype: precision.fp8_routed_experts false)",
           p.fp8_grad_format,
           p.fp8_output_head ? "FP8 too" : device_ == Device::CUDA ? "bf16" : "fp32",
           lora_ ? fmt::format(", the LoRA adapters in {}", p.compute_dtype) : "");
  if (const std::optional<Fp8Settings> settings = fp8_settings_of(config_); settings && !settings->filter_fqns.empty())
    log_info("{}", describe_fp8_filter(config_.model, *settings));  // NOTE [FP8 filter]
}

// Every rank says what it holds: the optimizer state (master weights and moments) is
// 1/N of the model's on each of the N shard ranks (NOTE [FSDP]).
void Trainer::log_fsdp_memory() const {
  if (!fsdp_)
    return log_info("data-parallel rank {} of {}, QLoRA: the NF4 base and the LoRA adapters ({} values) replicated "
                    "on every rank",
                    rank_, world_size_, lora_->stored_values());
  const FsdpMemory m = fsdp_->memory();
  auto gib = [](double b) { return fmt::format("{:.3f} GiB", b / (1024.0 * 1024.0 * 1024.0)); };
  const int shards = shard_group_->world_size();
  const int replicas = replicate_group_ ? replicate_group_->world_size() : 1;  // shard groups hold CP ranks too
  if (lora_) {
    const double chunk = static_cast<double>(fsdp_->master_shard().nbytes());
    const double base = static_cast<double>(config_.model.total_params()) *
                        static_cast<double>(dtype_size(fsdp_->master_shard().dtype()));
    return log_info("fsdp rank {} of {} (ZeRO-{}, {} shard ranks x {} replicas), LoRA: frozen base chunk {} = 1/{:.3f} "
                    "of the base's {}; compute weights {} (the chunk, the embedding and head in full{}); LoRA "
                    "adapters replicated: {} values",
                    rank_, world_size_, fsdp_->options().zero_stage, shards, replicas, gib(chunk),
                    base / chunk, gib(base), gib(static_cast<double>(m.compute_weights)),
                    fsdp_->options().fp8_all_gather  // NOTE [FP8 all-gather of a frozen base]
                        ? fmt::format(", {}{} as E4M3 codes (precision.fp8_fsdp_all_gather)",
                                      fsdp_->options().zero_stage == 3 ? "three gathered blocks" : "every block",
                                      fsdp_->gathers_fp8_head() ? " and the head" : "")
                    : fsdp_->options().zero_stage == 3 ? ", three gathered blocks"
                                                       : ", every block",
                    lora_->stored_values());
  }
  int64_t moments = 0;
  for (const Tensor& t : optimizer_->exp_avg()) moments += static_cast<int64_t>(t.nbytes());
  for (const Tensor& t : optimizer_->exp_avg_sq()) moments += static_cast<int64_t>(t.nbytes());
  const double moment_bytes = config_.optimizer.state_dtype == "bf16" ? 4.0 : 8.0;
  const double model_state = static_cast<double>(config_.model.total_params()) * (4.0 + moment_bytes);
  const double own_state = static_cast<double>(m.master_weights + moments);
  const int ep = fsdp_->options().expert_parallel;
  const std::string experts =
      ep > 1 ? fmt::format(", expert parallelism {}: routed experts {}-{} of {}", ep,
                           (rank_ % ep) * (config_.model.num_experts / ep),
                           (rank_ % ep + 1) * (config_.model.num_experts / ep) - 1, config_.model.num_experts)
             : std::string();
  log_info("fsdp rank {} of {} (ZeRO-{}, {} shard ranks x {} replicas{}): optimizer state {} (master {} + moments {}) "
           "= 1/{:.3f} of the model's {}; gradient chunk {}, full-size gradient buffers {}, compute weights {}{}, "
           "reduction buffers {}",
           rank_, world_size_, fsdp_->options().zero_stage, shards, replicas, experts, gib(own_state),
           gib(static_cast<double>(m.master_weights)), gib(static_cast<double>(moments)), model_state / own_state,
           gib(model_state), gib(static_cast<double>(m.gradient_shard)), gib(static_cast<double>(m.full_gradients)),
           gib(static_cast<double>(m.compute_weights)),
           !fsdp_->options().fp8_all_gather ? ""  // NOTE [FP8 all-gather]
           : fsdp_->gathers_fp8_head() ? " (the blocks' and the head's FP8 weights gathered as E4M3 codes: "
                                 "precision.fp8_fsdp_all_gather)"
                               : " (the blocks' FP8 weights gathered as E4M3 codes: precision.fp8_fsdp_all_gather)",
           gib(static_cast<double>(m.reduce_buffers)));
}

// NOTE [Device mesh]
// The ranks the launcher started form a mesh of tensor_parallel_degree T (innermost),
// context_parallel_degree C, the data-parallel ranks D (data_parallel_shard_degree x
// data_parallel_replicate_degree), and pipeline_parallel_degree P (outermost, as
// torchtitan's mesh and Megatron's order put it): rank = ((p D + d) C + c) T + t.
// Consecutive ranks split the layers (the busiest collectives, inside a node), the ranks of
// one data-parallel rank split its sequences, each data-parallel rank reads its own
// micro-batches, and the pipeline's point-to-point traffic, the lightest, crosses nodes.
// Expert-parallel groups are consecutive shard ranks, so under pipelining a stage's (NOTE
// [Expert parallelism under pipeline parallelism] in model/pipeline.h) and under hybrid
// sharding a replica's (NOTE [Expert parallelism under hybrid sharding] in
// distributed/expert_dispatch_group.cpp).
//
// NOTE [Context-parallel steps]
// The ranks of a context-parallel group read the same micro-batches and each computes its
// chunks' share of the gradients (NOTE [Context parallelism] in model/context_parallel.h),
// so for the gradients they are data-parallel ranks: FSDP shards over the data-parallel
// ranks' context-parallel ranks (C x data_parallel_shard_degree shard ranks, as
// torchtitan's dp_shard_cp) and sums their gradients. The step's scalars go through the
// same groups, where each group's C ranks report the same micro-batches' targets and
// losses (the decoder sums the losses over its group): those sums are divided by C.
void Trainer::set_up_data_parallel() {
  const ParallelismConfig& p = config_.parallelism;
  const LaunchEnv env = read_launch_env();
  const int64_t tp = p.tensor_parallel_degree, cp = p.context_parallel_degree, pp = p.pipeline_parallel_degree;
  const int64_t ranks = p.data_parallel_shard_degree * p.data_parallel_replicate_degree * tp * cp * pp;
  if (env.world_size == 1 && ranks > 1)
    FORGE_FAIL("parallelism.data_parallel_shard_degree × data_parallel_replicate_degree × tensor_parallel_degree × "
               "context_parallel_degree × pipeline_parallel_degree = {} × {} × {} × {} × {} = {} ranks, but this "
               "process was started alone: start {} ranks (forge launch --nproc-per-node {} -- train ..., torchrun "
               "or srun)",
               p.data_parallel_shard_degree, p.data_parallel_replicate_degree, tp, cp, pp, ranks, ranks, ranks);
  if (env.world_size != ranks)
    FORGE_FAIL("{} ranks were started ({}), but parallelism.data_parallel_shard_degree × "
               "data_parallel_replicate_degree × tensor_parallel_degree × context_parallel_degree × "
               "pipeline_parallel_degree = {} × {} × {} × {} × {} = {}: set them so that their product is the number "
               "of ranks",
               env.world_size, describe(env), p.data_parallel_shard_degree, p.data_parallel_replicate_degree, tp, cp,
               pp, ranks);
  if (ranks == 1) return;
  rank_ = env.rank;
  world_size_ = env.world_size;
  // NOTE [Device mesh]: rank = (((pipeline rank × D) + data-parallel rank) × C +
  // context-parallel rank) × T + tensor-parallel rank, D the data-parallel ranks.
  data_ranks_ = static_cast<int>(world_size_ / (tp * cp * pp));
  data_rank_ = static_cast<int>(rank_ / (tp * cp)) % data_ranks_;
  context_parallel_degree_ = static_cast<int>(cp);
  if (!world_) {
    own_world_ = create_process_group(env, process_group_options(config_));
    world_ = own_world_.get();
  }
  FORGE_CHECK(world_->world_size() == env.world_size, "the process group given has {} ranks, the launcher started {}",
              world_->world_size(), env.world_size);
  if (pp > 1) {
    // NOTE [Pipeline parallelism]: the ranks at the same place of every stage (the same
    // data-, context- and tensor-parallel rank: NOTE [Device mesh]) form a pipeline, in stage
    // order, and read the same micro-batches; the other degrees split within a stage below.
    const int stages = static_cast<int>(pp), per_stage = world_size_ / stages;
    const int virtual_stages = static_cast<int>(pipeline_virtual_stages(
        config_.model, pp, p.pipeline_parallel_layers_per_stage, parse_pipeline_schedule(p.pipeline_parallel_schedule)));
    ProcessGroup* pipeline = world_;
    if (per_stage > 1) {
      pipeline_group_ = world_->split(rank_ % per_stage, rank_);
      pipeline = pipeline_group_.get();
    }
    pipeline_ = std::make_unique<GroupPipelineParallel>(*pipeline);
    pipeline_comm_ = std::make_unique<DataParallelComm>(device_, *pipeline, nullptr);
    for (int v = 0; v < virtual_stages; ++v)
      pipeline_stages_.push_back(pipeline_stage(config_.model, stages, virtual_stages, pipeline_->rank(), v));
    if (per_stage > 1 && per_stage < world_size_) {
      // The ranks of this stage: the tensor- and data-parallel groups below are split from
      // them; checkpoints gather over every rank.
      stage_group_ = world_->split(rank_ / per_stage, rank_);
      world_comm_ = std::make_unique<DataParallelComm>(device_, *world_, nullptr);
    }
  }
  // Without pipelining the stage is the world; `local` is the rank within it.
  ProcessGroup* stage_world = stage_group_ ? stage_group_.get() : world_;
  const int local = stage_world->rank();
  ProcessGroup* data_world = stage_world;
  if (cp > 1) {
    // The ranks of the same data-parallel and tensor-parallel rank split the sequences.
    const int t = static_cast<int>(tp);
    context_parallel_group_ = stage_world->split(data_rank_ * t + local % t, local);
    context_parallel_ = std::make_unique<GroupContextParallel>(*context_parallel_group_);
    context_parallel_->set_rotate_method(  // NOTE [Ring attention] in model/context_parallel_ring.h
        parse_context_parallel_rotate(config_.parallelism.context_parallel_rotate_method));
  }
  if (tp > 1) {
    // NOTE [Tensor parallelism]: consecutive ranks split the layers (they share a node when
    // the degree is at most the ranks per node, where its collectives belong); the ranks the
    // degree apart, with the same shards, are the data-parallel world.
    const int t = static_cast<int>(tp);
    tensor_parallel_group_ = stage_world->split(local / t, local);
    if (config_.precision.fp8_fsdp_all_gather) fp8_gather_tensor_parallel_group_ = stage_world->split(local / t, local);
    data_parallel_group_ = stage_world->split(local % t, local);
    tensor_parallel_ = std::make_unique<GroupTensorParallel>(*tensor_parallel_group_);
    tensor_parallel_->set_async(p.enable_async_tensor_parallel);  // NOTE [Async tensor parallelism]
    tensor_parallel_comm_ = std::make_unique<DataParallelComm>(device_, *tensor_parallel_group_, nullptr);
    world_comm_ = std::make_unique<DataParallelComm>(device_, *world_, nullptr);
    tensor_parallel_shard_ = {local % t, t};
    data_world = data_parallel_group_.get();
  }
  shard_group_ = data_world;
  if (p.data_parallel_replicate_degree > 1) {
    // Consecutive data-parallel ranks shard (they share a node when the shard degree is the
    // ranks per node); ranks the shard degree apart hold the same shard. A shard group holds
    // its data-parallel ranks' context-parallel ranks too (NOTE [Context-parallel steps]).
    const int shard = static_cast<int>(p.data_parallel_shard_degree * cp);
    const int index = data_world->rank();  // data-parallel rank × C + context-parallel rank
    shard_split_ = data_world->split(index / shard, index);
    replicate_group_ = data_world->split(index % shard, index);
    shard_group_ = shard_split_.get();
  }
  if (p.expert_parallel_degree > 1) {  // config rules: P divides the shard ranks
    // NOTE [Expert parallelism under pipeline parallelism] in model/pipeline.h: P
    // consecutive ranks are P consecutive shard ranks of one stage (no tensor or context
    // parallelism with experts), so the groups never cross a pipeline rank, nor a replica
    // (NOTE [Expert parallelism under hybrid sharding] in distributed/expert_dispatch_group.cpp);
    // the ranks holding the same experts are those of the rank's shard group, in its stage.
    const int ep = static_cast<int>(p.expert_parallel_degree);
    const int shard = static_cast<int>(p.data_parallel_shard_degree);
    expert_parallel_group_ = world_->split(rank_ / ep, rank_);
    expert_shard_group_ = stage_world->split((local / shard) * ep + local % ep, local);
    expert_dispatch_ = std::make_unique<GroupExpertDispatch>(*expert_parallel_group_, device_);
  }
}

ExpertShard Trainer::expert_shard() const {
  // The expert-parallel group of rank r: ranks [r - r % P, r - r % P + P), r its (r % P)-th
  // (under pipeline parallelism all of one stage: P divides its ranks).
  const int64_t ep = config_.parallelism.expert_parallel_degree;
  return {rank_ % ep, ep};
}

Trainer::~Trainer() = default;

Device compute_device(const ExperimentConfig& config) {
  if (config.training.device == "cuda") {
    if (!cuda_available())
      FORGE_FAIL("training.device is 'cuda' but {}", kCudaBuilt ? "no GPU is visible"
                                                                      : "this build of forge has no CUDA backend");
    if (config.precision.compute_dtype != "bf16")
      FORGE_FAIL("precision.compute_dtype '{}' is not available on CUDA: use bf16", config.precision.compute_dtype);
    return Device::CUDA;
  }
  if (config.precision.compute_dtype != "fp32")
    FORGE_FAIL("precision.compute_dtype '{}' is not available on the CPU reference path: use fp32",
               config.precision.compute_dtype);
  return Device::CPU;
}

uint64_t dataset_seed(const TrainingConfig& training) { return derive_seed(training.seed, kDataSeed); }

ProcessGroupOptions process_group_options(const ExperimentConfig& config) {
  const ParallelismConfig& p = config.parallelism;
  ProcessGroupOptions options;
  options.device = config.training.device == "cuda" ? Device::CUDA : Device::CPU;
  options.rendezvous_timeout = std::chrono::milliseconds(static_cast<int64_t>(p.rendezvous_timeout_s * 1000));
  options.collective_timeout = std::chrono::milliseconds(static_cast<int64_t>(p.nccl_timeout_s * 1000));
  options.heartbeat_timeout = std::chrono::milliseconds(static_cast<int64_t>(p.heartbeat_timeout_s * 1000));
  return options;
}

const FlatParameters& Trainer::parameters() const {
  FORGE_CHECK(params_, "Trainer::parameters(): a data-parallel run holds shards and a QLoRA run NF4 codes, not the "
                       "full parameters");
  return *params_;
}

ParamSource& Trainer::weights() {
  if (lora_) return *lora_;  // over FSDP's frozen base under data parallelism
  if (fp8_) return *fp8_;    // over FSDP's or the flat weights
  if (fsdp_) return *fsdp_;
  return compute_weights_ ? *compute_weights_ : *params_;
}

GradSink& Trainer::gradients() {
  if (lora_) return *lora_;
  if (fp8_) return *fp8_;
  if (fsdp_) return *fsdp_;
  return *grads_;
}

std::vector<Tensor> Trainer::trainable_weights() const { return lora_ ? lora_->masters() : params_->tensors(); }

std::vector<Tensor> Trainer::trainable_gradients() const { return lora_ ? lora_->gradients() : grads_->tensors(); }

std::vector<std::string> Trainer::trainable_names() const {
  if (lora_) return lora_->master_names();
  std::vector<std::string> names;
  for (const ParamSpec& spec : params_->specs()) names.push_back(spec.name);
  return names;
}

void Trainer::discard_gradients() {
  if (lora_) lora_->discard();
  else grads_->discard();
}

// NOTE [Routing bias update]
// Auxiliary-loss-free balancing (DeepSeek-V3, arXiv 2412.19437 section 2.1.2; Megatron's
// moe_router_enable_expert_bias with moe_router_bias_update_rate): sigmoid routing chooses
// each token's experts on score + bias (NOTE [MoE routing] in ops/moe.h), and after every
// optimizer step each block's bias moves towards balance,
//   bias_e += rate x sign(mean load - load_e)
// with load_e the assignments expert e received over the step's micro-batches (the
// expert_load the step logs) and the mean over the block's experts: an overloaded expert's
// bias falls, an idle one's rises, an expert at the mean keeps its bias. The bias is a
// parameter without gradient (AdamW leaves it alone), so the update writes the fp32 master
// value and, on CUDA, its bf16 compute copy. A skipped step (non-finite, loss spike)
// updates nothing, as it updates no weight. Under FSDP the loads are the sum over the
// data-parallel ranks (loads_over_ranks, as Megatron all-reduces its tokens per expert),
// the same on every rank, and each rank moves the biases in its own chunk of the master
// weights (and its compute chunk when the optimizer wrote that) before the compute weights
// are gathered: the biases stay identical to a one-process run's.
void Trainer::update_routing_biases(const std::vector<std::vector<int64_t>>& expert_load, bool chunk_written) {
  const ModelConfig& m = config_.model;
  if (sharded_gradients()) {
    const FsdpLayout& layout = fsdp_->layout();
    for (size_t i = 0; i < layout.segments().size(); ++i) {
      const FsdpSegment& segment = layout.segments()[i];
      const ParamSpec& spec = layout.specs()[static_cast<size_t>(segment.spec)];
      if (!spec.name.ends_with(".moe.router.bias")) continue;
      const std::vector<int64_t>& load = expert_load.at(static_cast<size_t>(spec.layer - m.first_dense_layers));
      const Tensor& master = fsdp_->master_segments()[i];
      Tensor bias = master.to(Device::CPU);
      moe_update_routing_bias(bias, load, m.router_bias_update_rate, segment.param_begin);
      copy_bytes(master.raw(), master.device(), bias.raw(), Device::CPU, bias.nbytes());
      const Tensor& compute = fsdp_->compute_segments()[i];
      if (chunk_written && compute.defined()) cast(compute, master);
    }
    return;
  }
  // The rank's biases: every block's, or under pipeline parallelism its stages' blocks'.
  for (const ParamSpec& spec : params_->specs()) {
    if (!spec.name.ends_with(".moe.router.bias")) continue;
    const Tensor& master = params_->find(spec.name);
    Tensor bias = master.to(Device::CPU);
    moe_update_routing_bias(bias, expert_load.at(static_cast<size_t>(spec.layer - m.first_dense_layers)),
                            m.router_bias_update_rate);
    copy_bytes(master.raw(), master.device(), bias.raw(), Device::CPU, bias.nbytes());
    if (compute_weights_) cast(compute_weights_->find(spec.name), master);
  }
}


// NOTE [Tensor-parallel gradient norm]
// Under tensor parallelism (NOTE [Tensor parallelism] in model/tensor_parallel.h) the
// global gradient is every rank's shards once, and the replicated parameters (the norm
// weights, whose gradients the group has already summed: every rank of a group holds the
// same values) once more. So each rank counts its shards' squares in full and a
// replicated parameter's with weight 1/T; the sum over the data-parallel ranks (FSDP's
// chunks, or the whole on one data-parallel rank) and then over the tensor-parallel group
// is the whole model's squared norm, the one clipping uses on every rank. (LoRA's adapters
// are whole on every rank once their gradients are summed: their own norm is the global one.)
double Trainer::tensor_parallel_grad_sum_of_squares() {
  const double replicated = 1.0 / static_cast<double>(tensor_parallel_shard_.size);
  double sum = 0.0;
  if (fsdp_) {
    sum = fsdp_->global_grad_sum_of_squares(replicated);
  } else {
    for (size_t i = 0; i < grads_->specs().size(); ++i)
      sum += sum_of_squares(grads_->tensors()[i]) *
             (grads_->specs()[i].tensor_parallel == TensorParallelSplit::Replicated ? replicated : 1.0);
  }
  return tensor_parallel_comm_->sum_over_ranks(sum);
}

void Trainer::begin_gradients() {
  if (dp_) dp_->reset_exposed_comm();  // what evaluation waited for is not the step's
  if (fsdp_) fsdp_->begin_step();
  if (!sharded_gradients()) discard_gradients();  // NOTE [Fresh gradient buffers]: no zeroing pass
}

// NOTE [LoRA under data parallelism]
// With several data-parallel ranks a LoRA run keeps its frozen base in a frozen Fsdp (NOTE
// [Frozen FSDP base]: each shard rank holds its chunk in the compute dtype, blocks gathered
// around their use in ZeRO-3) and the adapters, their gradients and their AdamW state whole
// on every rank. Each rank reads its micro-batches (NOTE [Data-parallel steps]) and writes
// its adapter gradients; after the step's last backward the flat gradient buffer (its
// padding zero) is summed over every rank, once. The loss is already divided by the global
// target count (NOTE [Loss normalization]), so the sum is the global gradient, its norm the
// global norm with no further reduction, and the optimizer, run alike on every rank, keeps
// the adapters bitwise identical everywhere (every rank receives the same bits from the
// all-reduce). Checkpoints hold the adapters alone (NOTE [LoRA checkpoints]) as one shard,
// written by rank 0; the PEFT adapter is written by rank 0; the merged Hugging Face export
// gathers the base to rank 0's host (Fsdp::gather_to_host) and merges there.
// QLoRA's NF4 base is not sharded but replicated: every rank imports and quantizes the
// whole base (bitwise the same codes everywhere; under tensor parallelism the ranks with the
// same shards, NOTE [NF4 base under tensor parallelism]), and a DataParallelComm alone
// carries the collectives (the adapters' all-reduce, the loss, the counts); rank 0 exports.
// Context-parallel ranks count as data-parallel ones here; under tensor parallelism the
// adapters' gradients are first spread from the split matrices' shards and summed over the
// tensor-parallel group (NOTE [LoRA under context and tensor parallelism] in model/lora.h).
void Trainer::finish_gradients() {
  if (fsdp_) fsdp_->finish_gradients();
  if (!lora_) return;
  if (pipeline_comm_) lora_->zero_unwritten_gradients();  // NOTE [LoRA under pipeline parallelism]
  if (tensor_parallel_) {  // NOTE [LoRA under context and tensor parallelism]
    lora_->spread_shard_gradients();
    tensor_parallel_comm_->all_reduce_sum(lora_->gradient_flat());
  }
  if (pipeline_comm_) pipeline_comm_->all_reduce_sum(lora_->gradient_flat());
  if (dp_) dp_->all_reduce_sum(lora_->gradient_flat());
}

std::vector<ParamSpec> Trainer::checkpoint_specs() const {
  return lora_ ? lora_->checkpoint_specs() : parameter_specs(config_.model);
}

// Everything that can refuse the run (an old run without a checkpoint, a bad checkpoint)
// happens before the first write, so a refused run leaves the directory as it was.
void Trainer::prepare_run_dir() {
  run_dir_ = expand_run_dir(config_.logging.run_dir, config_.model.name);
  const CheckpointConfig& ckpt = config_.checkpoint;
  if (ckpt.enable) resume_from_ = choose_checkpoint();
  const bool earlier_run = std::filesystem::exists(run_dir_ + "/metrics.jsonl");
  if (earlier_run && !resume_from_ && ckpt.enable) {
    // A requeued job whose first attempt died before its first checkpoint: the same
    // command starts the run again from step 0, appending to metrics.jsonl.
    log_warn("run directory '{}' holds an earlier attempt (metrics.jsonl) but '{}' no checkpoint: starting the run "
             "afresh from step 0",
             run_dir_, checkpoint_folder());
  } else if (earlier_run && !resume_from_) {
    FORGE_FAIL("run directory '{}' already holds a run (metrics.jsonl); choose another logging.run_dir, or enable "
               "checkpoint.enable to resume it from its checkpoints",
               run_dir_);
  }
  if (resume_from_) {
    // A LoRA checkpoint holds the adapters only: the frozen base is loaded again.
    if (lora_ && !ckpt.initial_load_path.empty()) load_initial_weights(ckpt.initial_load_path);
    else if (!ckpt.initial_load_path.empty())
      log_info("checkpoint.initial_load_path is ignored: resuming from a checkpoint of this run");
    if (lora_ && !config_.lora.adapter_path.empty())
      log_info("lora.adapter_path is ignored: resuming from a checkpoint of this run");
    restore_checkpoint(*resume_from_);
  } else {
    if (!ckpt.initial_load_path.empty()) load_initial_weights(ckpt.initial_load_path);
    if (lora_ && !config_.lora.adapter_path.empty()) {
      load_peft_adapter(config_.lora.adapter_path, *lora_);
      log_info("LoRA adapters from the PEFT adapter '{}' (lora.adapter_path)", config_.lora.adapter_path);
    }
  }
  // A finished run started again (a requeue) has nothing to train and keeps the export it made.
  hf_export_done_ = ckpt.last_save_in_hf && resume_from_ && start_step_ >= config_.training.steps &&
                    std::filesystem::is_directory(run_dir_ + "/hf") && !std::filesystem::is_empty(run_dir_ + "/hf");
  if (ckpt.last_save_in_hf && !hf_export_done_) {
    check_hf_export_target(run_dir_ + "/hf");
    check_hf_exportable(config_.model, ckpt.initial_load_in_hf ? ckpt.initial_load_path : "");
    FORGE_CHECK(ckpt.export_dtype == "bf16" || ckpt.export_dtype == "fp16" || ckpt.export_dtype == "fp32",
                "checkpoint.export_dtype '{}': the cli resolves auto before a run (load_experiment)", ckpt.export_dtype);
  }
  // Every rank has made its checks before rank 0 writes (another rank would otherwise
  // see rank 0's fresh metrics.jsonl as an earlier run).
  if (world_) world_->barrier();
  earlier_run_ = earlier_run;
  if (rank_ != 0) return;
  create_run_dir(run_dir_);
  write_file_atomic(run_dir_ + "/config.yaml", resolved_yaml_, {.sync = false});  // NOTE [Durable files]
  record_restart(run_dir_, resume_from_);  // NOTE [Launcher restarts]
  metrics_ = std::make_unique<MetricsWriter>(run_dir_ + "/metrics.jsonl");
  if (config_.logging.enable_tensorboard) metrics_->enable_tensorboard(run_dir_, start_step_);
  if (earlier_run) log_info("appending to {}/metrics.jsonl from step {}", run_dir_, start_step_ + 1);
}

double Trainer::lr_for_step(int64_t step) const {
  return lr_at(config_.optimizer, config_.lr_scheduler, step, config_.training.steps);
}

// NOTE [Evaluation mean]
// eval.average tokens: the loss is the mean over every counted target of the evaluation
// (each token weighs the same, as NOTE [Loss normalization]). micro_batches: the mean of
// each micro-batch's own mean, as Hugging Face Trainer's eval_loss (which averages the
// per-batch losses over the samples): with training.local_batch_size 1 every sequence
// weighs the same however many of its tokens are counted, which is what MLPerf's Llama 2 70B
// LoRA reference measures on GovReport. A micro-batch without a counted target is left
// out of that mean, as it adds nothing to the token mean.
//
// NOTE [Evaluation under data parallelism]
// With several data-parallel ranks and eval.steps a multiple of their number, rank r
// evaluates micro-batches r, r + world, ... of the evaluation (the DataLoader's rank and
// world, as training reads its batches), and the loss sums, target counts and micro-batch
// means are added over the ranks: the same sequences and the same mean as on one device (up
// to the order of the additions), in 1/world of the time. Otherwise every rank evaluates
// every micro-batch (correct, world times the work; the log says so once).
EvalMetrics Trainer::evaluate(int64_t step) {
  const bool split = dp_ && data_ranks_ > 1 && config_.eval.steps % data_ranks_ == 0;
  if (dp_ && data_ranks_ > 1 && !split && rank_ == 0 && eval_split_noted_++ == 0)
    log_info("eval.steps {} is not a multiple of the {} data-parallel ranks: every rank evaluates all of them",
             config_.eval.steps, data_ranks_);
  DataLoader loader(*eval_data_, config_.training.local_batch_size, 0, split ? data_rank_ : 0, split ? data_ranks_ : 1);
  if (lora_) lora_->set_training(false);  // no adapter dropout, as PEFT's eval()
  LossSum total;
  double batch_means = 0.0;
  int64_t counted_batches = 0;
  for (int64_t i = 0; i < (split ? config_.eval.steps / data_ranks_ : config_.eval.steps); ++i) {
    Batch batch = loader.next();
    const SequenceLayout layout = sequence_layout(batch);
    const SequenceLayout* examples = batch.has_examples() ? &layout : nullptr;
    LossSum l = pipeline_model_
                    ? pipeline_model_->forward_loss({batch.tokens.to(device_), batch.targets.to(device_), examples},
                                                    weights())
                    : model_->forward_loss(batch.tokens.to(device_), batch.targets.to(device_), weights(), examples);
    if (pipeline_comm_) {  // NOTE [Pipeline parallelism]: the loss is on the last stage's rank
      l.sum = pipeline_comm_->sum_over_ranks(l.sum);
      l.tokens = pipeline_comm_->count_over_ranks(l.tokens);
    }
    total.sum += l.sum;
    total.tokens += l.tokens;
    if (l.tokens > 0) {
      batch_means += l.mean();
      ++counted_batches;
    }
  }
  if (lora_) lora_->set_training(true);
  if (split) {
    std::tie(total.sum, batch_means) = dp_->sum_over_ranks(total.sum, batch_means);
    total.tokens = dp_->count_over_ranks(total.tokens);
    // NOTE [Context-parallel steps]: each of a group's C ranks reported the same batches.
    total.sum /= context_parallel_degree_;
    batch_means /= context_parallel_degree_;
    total.tokens /= context_parallel_degree_;
    counted_batches = dp_->count_over_ranks(counted_batches);
  }
  EvalMetrics m;
  m.step = step;
  m.loss = config_.eval.average == "micro_batches"
               ? (counted_batches > 0 ? batch_means / static_cast<double>(counted_batches) : total.mean())
               : total.mean();
  m.perplexity = std::exp(m.loss);
  m.tokens = total.tokens;
  return m;
}

TrainResult Trainer::run() {
  prepare_run_dir();
  const TrainingConfig& t = config_.training;
  const ModelConfig& mc = config_.model;
  const int64_t accum = t.gradient_accumulation_steps;
  const double tokens_per_step = static_cast<double>(t.global_batch_size * t.seq_len);
  const double flops_per_step = training_flops_per_token(mc, config_.lora, t.seq_len) * tokens_per_step;
  const std::optional<double> peak = peak_tflops(accelerator_name());
  const std::optional<double> fp8_peak =
      config_.precision.fp8 != "none" ? peak_fp8_tflops(accelerator_name()) : std::nullopt;
  set_op_profiling(config_.logging.profile_ops);
  set_gemm_tuning(t.gemm_tuning, t.gemm_tuning ? gemm_tuning_cache_dir(t.gemm_tuning_cache) : "");

  TrainResult result;
  result.run_dir = run_dir_;
  result.entropy_floor = train_data_->entropy_floor();

  log_info("model {}: {} parameters, {} layers, hidden {}, heads {}/{} (q/kv), vocab {}", mc.name,
           human_count(static_cast<double>(mc.total_params())), mc.num_layers, mc.hidden_size, mc.num_heads,
           mc.num_kv_heads, mc.vocab_size);
  if (lora_)
    log_info("LoRA rank {}, alpha {}, dropout {} on {}: {} trainable parameters in {} adapted projections; the "
             "model's own are frozen in {}",
             config_.lora.rank, config_.lora.alpha, config_.lora.dropout, config_.lora.target_modules,
             human_count(static_cast<double>(lora_->trainable_params())), lora_->targets().size(),
             nf4_base_ ? fmt::format("NF4 (the block projections; the rest in {})", config_.precision.compute_dtype)
                       : config_.precision.compute_dtype);
  if (lora_ && mc.mla())  // NOTE [LoRA on MoE and MLA models]
    for (const LoraTarget& target : lora_->targets())
      if (const std::string& m = target.parts.front().module;
          m == "gate_proj" || m == "up_proj" || m == "down_proj" || m == "gate_up_proj") {
        log_warn("LoRA on the feed-forward of a DeepSeek-family model ({}): PEFT 0.21 on transformers 5 maps "
                 "gate_proj, up_proj and down_proj to the routed experts, so {}/adapter loads into PEFT on "
                 "transformers 4 only; forge eval and generate (--adapter) and the merged export carry these adapters",
                 target.name, run_dir_);
        break;
      }
  log_info("batch: {} micro-batch x {} accumulation = {} sequences of {} tokens per step; {} steps on {} ({} threads)",
           t.local_batch_size, accum, t.global_batch_size, t.seq_len, t.steps, t.device, num_threads());
  log_info("data: {}{}", config_.data.source,
           result.entropy_floor > 0 ? fmt::format(" (entropy floor {:.4f} nats/token)", result.entropy_floor) : "");
  log_info("run directory: {}", run_dir_);
  nlohmann::json run_record = {{"type", "run"},
                               {"model", mc.name},
                               {"parameters", mc.total_params()},
                               {"flops_per_token", training_flops_per_token(mc, config_.lora, t.seq_len)},
                               {"tokens_per_step", tokens_per_step},
                               {"ranks", world_size_},
                               {"device", accelerator_name()}};
  run_record["entropy_floor"] = result.entropy_floor > 0 ? nlohmann::json(result.entropy_floor) : nlohmann::json(nullptr);
  if (metrics_) metrics_->write(run_record);
  if (metrics_ && (resume_from_ || earlier_run_))
    metrics_->write(nlohmann::json{{"type", "resume"},
                                   {"step", start_step_},
                                   {"checkpoint", resume_from_ ? nlohmann::json(*resume_from_) : nlohmann::json(nullptr)}});
  if (start_step_ >= t.steps)
    log_info("the checkpoint is at step {}, training.steps is {}: nothing left to train", start_step_, t.steps);

  // A long run in a terminal shows a progress bar between its log lines; elsewhere the
  // log lines (every logging.log_interval steps) are the progress.
  std::optional<ProgressReporter> progress;
  if (show_progress_ && rank_ == 0 && isatty(fileno(stderr))) {
    progress.emplace(true);
    progress->start(static_cast<double>(t.steps), "training");
  }
  auto log_line = [&](const std::string& line) {
    if (progress) progress->clear();
    log_info("{}", line);
  };
  std::vector<Batch> batches(accum);
  const int64_t samples_per_step = t.global_batch_size;
  if (observer_) observer_->training_begins(start_step_ * samples_per_step);
  for (int64_t step = start_step_; step < t.steps; ++step) {
    report_step(step + 1);  // NOTE [Failure detection]
    debug_hang_if_requested(rank_, step + 1);
    reset_op_profile();
    auto t0 = std::chrono::steady_clock::now();
    double lr = lr_for_step(step);
    begin_gradients();
    if (model_) model_->begin_step();  // NOTE [MoE balancing loss]: the global loss's counts start over
    // NOTE [Data-parallel steps]: every rank reads its own micro-batches of the global batch.
    int64_t targets = 0;
    for (int64_t a = 0; a < accum; ++a) {
      Batch& b = batches[static_cast<size_t>(a)];
      b = train_loader_->next();
      const int32_t* tg = b.targets.data<int32_t>();
      for (int64_t i = 0; i < b.targets.numel(); ++i) targets += tg[i] != kIgnoreIndex;
    }
    // NOTE [Context-parallel steps]: each of a group's C ranks counted the same targets.
    if (dp_) targets = dp_->count_over_ranks(targets) / context_parallel_degree_;
    const float grad_scale = targets > 0 ? 1.0f / static_cast<float>(targets) : 0.0f;
    LossSum loss;
    std::vector<std::vector<int64_t>> expert_load;  // NOTE [MoE feed-forward]: summed over the micro-batches
    std::vector<double> micro_losses(static_cast<size_t>(accum));
    if (pipeline_model_) {
      // NOTE [Pipeline parallelism]: the step's micro-batches through the schedule at once.
      std::vector<SequenceLayout> layouts(static_cast<size_t>(accum));
      std::vector<PipelineMicroBatch> micro(static_cast<size_t>(accum));
      for (size_t a = 0; a < micro.size(); ++a) {
        layouts[a] = sequence_layout(batches[a]);
        micro[a] = {batches[a].tokens.to(device_), batches[a].targets.to(device_),
                    batches[a].has_examples() ? &layouts[a] : nullptr};
      }
      // NOTE [LoRA under pipeline parallelism]: each micro-batch's dropout masks, one process's.
      std::function<void(int)> before_micro_batch;
      if (lora_)
        before_micro_batch = [&](int a) {
          lora_->set_dropout_step(lora_dropout_seed(t.seed, context_parallel_.get()),
                                  static_cast<uint64_t>(step * accum + a));
        };
      loss = pipeline_model_->forward_backward(micro, weights(), gradients(), grad_scale, before_micro_batch);
      if (fsdp_) fsdp_->reduce_gradients();  // ZeRO-1: once, after every micro-batch's backward (ZeRO-2/3: done)
      for (size_t a = 0; a < micro.size(); ++a) micro_losses[a] = pipeline_model_->micro_batch_losses()[a].sum;
      // Every MoE block's loads, zeros for other ranks' stages: summed over the pipeline below.
      if (config_.model.moe()) expert_load = pipeline_model_->expert_load();
      loss.tokens = targets;
      if (inject_nan_ && (!sharded_gradients() || inject_nan_->fp8_amax))
        inject_test_nan(step + 1, inject_nan_->micro_batch);
    }
    for (int64_t a = 0; a < (pipeline_model_ ? 0 : accum); ++a) {
      const Batch& b = batches[static_cast<size_t>(a)];
      if (fsdp_) fsdp_->begin_micro_batch(a == accum - 1);
      const SequenceLayout layout = sequence_layout(b);
      if (lora_) {
        const uint64_t micro_batch = static_cast<uint64_t>(step * accum + a);
        lora_->set_dropout_step(lora_dropout_seed(t.seed, context_parallel_.get()), micro_batch);
      }
      LossSum l = model_->forward_backward(b.tokens.to(device_), b.targets.to(device_), weights(), gradients(),
                                           grad_scale, b.has_examples() ? &layout : nullptr);
      if (fsdp_) fsdp_->end_micro_batch();
      if (inject_nan_ && (!sharded_gradients() || inject_nan_->fp8_amax)) inject_test_nan(step + 1, a);
      micro_losses[static_cast<size_t>(a)] = l.sum;
      if (config_.model.moe()) add_expert_load(expert_load, model_->expert_load());
      loss.sum += l.sum;
      loss.tokens += l.tokens;
    }
    // Every rank routed its own tokens: the step's loads are the sum over the ranks, and
    // under pipeline parallelism over the stages, each holding its own blocks' (NOTE
    // [Pipeline stages]).
    if (dp_ && config_.model.moe() && !expert_load.empty()) expert_load = loads_over_ranks(expert_load, *dp_);
    if (pipeline_comm_ && config_.model.moe() && !expert_load.empty())
      expert_load = loads_over_ranks(expert_load, *pipeline_comm_);
    double norm = 0.0;
    // NOTE [Stop signals]: read once per step; every rank agrees through the loss's all-reduce.
    bool stop_now = stop_signal() != 0;
    // NOTE [FP8 step end]: this rank's first non-finite amax, if any; the ranks that saw one
    // are counted in the loss's all-reduce (NOTE [FP8 under data parallelism]).
    const Fp8Projections::NonfiniteAmax own_amax = fp8_ ? fp8_->first_nonfinite_amax() : Fp8Projections::NonfiniteAmax{};
    int64_t amax_ranks = own_amax.slot >= 0 ? 1 : 0;
    if (dp_) {
      const std::vector<double> sums =
          dp_->sum_over_ranks(std::vector<double>{loss.sum, stop_now ? 1.0 : 0.0, static_cast<double>(amax_ranks)});
      loss.sum = sums[0] / context_parallel_degree_;  // NOTE [Context-parallel steps]
      stop_now = sums[1] > 0;
      amax_ranks = std::llround(sums[2]);
      loss.tokens = targets;
      finish_gradients();
      if (inject_nan_ && sharded_gradients() && !inject_nan_->fp8_amax && inject_nan_->micro_batch < accum)
        inject_test_nan(step + 1, inject_nan_->micro_batch);
      // Replicated adapters hold the global gradient after finish_gradients: their norm is the global one.
      if (lora_) norm = global_grad_norm({lora_->gradient_flat()});
      else if (!tensor_parallel_) norm = std::sqrt(fsdp_->global_grad_sum_of_squares());
    } else if (lora_ && (tensor_parallel_ || pipeline_comm_)) {
      finish_gradients();  // the adapters' gradients summed over the tensor-parallel and pipeline groups
      norm = global_grad_norm({lora_->gradient_flat()});
    } else if (!tensor_parallel_) {
      norm = global_grad_norm({lora_ ? lora_->gradient_flat() : grads_->flat()});
    }
    if (pipeline_comm_) {
      // NOTE [Pipeline parallelism]: the loss is on the last stage's rank, each rank's
      // gradients are its stages' parameters'.
      // This rank's sum of squares (under tensor parallelism its group's, NOTE [Tensor-parallel gradient norm]);
      // LoRA's adapters hold the whole gradient by now (NOTE [LoRA under pipeline parallelism]).
      const double own = lora_ ? 0.0 : tensor_parallel_ ? tensor_parallel_grad_sum_of_squares() : norm * norm;
      // The ranks that saw a non-finite FP8 amax too (NOTE [FP8 under context and pipeline parallelism]).
      const std::vector<double> sums = pipeline_comm_->sum_over_ranks(
          std::vector<double>{loss.sum, stop_now ? 1.0 : 0.0, own, static_cast<double>(amax_ranks)});
      loss.sum = sums[0];
      stop_now = sums[1] > 0;
      if (!lora_) norm = std::sqrt(sums[2]);
      amax_ranks = std::llround(sums[3]);
    }
    if (tensor_parallel_) {
      // LoRA's adapters hold the whole gradient on every rank by now: their norm is the global one.
      if (!pipeline_comm_ && !lora_) norm = std::sqrt(tensor_parallel_grad_sum_of_squares());
      // NOTE [Stop signals]: a tensor-parallel group stops together too, and skips a step
      // with a non-finite FP8 amax together (NOTE [FP8 under tensor parallelism]).
      const auto [stops, saw_amax] =
          tensor_parallel_comm_->sum_over_ranks(stop_now ? 1.0 : 0.0, static_cast<double>(amax_ranks));
      stop_now = stops > 0;
      amax_ranks = std::llround(saw_amax);
    }
    for (const LossScaling& s : scale_loss_)
      if (s.step == step + 1) loss.sum *= s.factor;
    // NOTE [Non-finite steps]: loss and norm are on the host already (and agreed by every rank).
    // NOTE [FP8 step end]: a non-finite FP8 amax on any rank makes the step non-finite too.
    const std::string fp8_amax = amax_ranks > 0 ? describe_nonfinite_amax(own_amax, amax_ranks) : std::string();
    const bool finite = std::isfinite(loss.sum) && std::isfinite(norm) && fp8_amax.empty();
    if (!finite) {
      if (progress) progress->clear();
      handle_nonfinite(step + 1, batches, grad_scale, micro_losses, loss.mean(), norm, fp8_amax);  // throws unless skipping
    }
    // NOTE [Loss spikes]: the global loss, the same on every rank.
    const LossSpikeDetector::Verdict spike = finite ? loss_spike_.observe(loss.mean()) : LossSpikeDetector::Verdict{};
    if (spike.spike && progress) progress->clear();
    const bool skip = !finite || (spike.spike && handle_loss_spike(step + 1, loss.mean(), spike));
    if (fp8_) end_fp8_step(/*update=*/!skip);
    if (skip) {
      if (sharded_gradients()) fsdp_->refresh_compute_weights(false);  // from the unchanged master weights
    } else if (sharded_gradients()) {
      skipped_in_a_row_ = 0;
      const bool fused_copy = device_ == Device::CUDA;  // AdamW writes the bf16 chunk as it updates
      optimizer_->step(fsdp_->grad_segments(), lr, clip_coefficient(norm, t.max_norm),
                       fused_copy ? fsdp_->compute_segments() : std::vector<Tensor>{});
      if (config_.model.router_bias_update_rate > 0) update_routing_biases(expert_load, fused_copy);
      fsdp_->refresh_compute_weights(fused_copy);
    } else {
      skipped_in_a_row_ = 0;
      optimizer_->step(trainable_gradients(), lr, clip_coefficient(norm, t.max_norm),
                       compute_weights_ ? compute_weights_->tensors() : std::vector<Tensor>{});
      if (lora_) lora_->refresh_compute();
      if (config_.model.router_bias_update_rate > 0) update_routing_biases(expert_load, false);
    }
    double dt = seconds_since(t0);

    StepMetrics m;
    m.step = step + 1;
    m.loss = loss.mean();
    m.lr = lr;
    m.grad_norm = norm;
    m.step_time_s = dt;
    m.skipped = skip;
    m.skipped_steps = skipped_steps_;
    if (spike.spike) m.loss_spike_mean = spike.mean;
    m.loss_spikes = static_cast<int64_t>(loss_spike_steps_.size());
    if (config_.model.moe_capacity_factor > 0 && !expert_load.empty())
      m.expert_dropped_share = dropped_share(expert_load, tokens_per_step * static_cast<double>(mc.num_experts_per_tok));
    m.expert_load = std::move(expert_load);
    // Per GPU, as torchtitan and Megatron report them: the global work over the ranks.
    m.tokens_per_s = tokens_per_step / dt / world_size_;
    m.model_tflops = flops_per_step / dt / 1e12 / world_size_;
    if (peak) m.mfu = m.model_tflops / *peak;
    if (fp8_peak) m.mfu_fp8 = m.model_tflops / *fp8_peak;
    if (device_ == Device::CUDA) m.peak_memory_bytes = static_cast<int64_t>(device_memory_peak());
    if (dp_) m.comm_exposed_s = dp_->take_exposed_comm_seconds();
    if (op_profiling()) {
      m.op_seconds = op_profile_seconds();
      m.op_seconds_by_op = op_profile_seconds_by_op();
    }
    result.losses.push_back(m.loss);
    result.step_seconds.push_back(dt);
    if (metrics_) metrics_->write(m);
    if (skip && skipped_in_a_row_ >= t.max_skipped_steps)
      FORGE_FAIL("training diverged: {} steps in a row up to step {} had a non-finite loss or gradient norm, or a loss "
                 "spike, and were skipped (training.max_skipped_steps {}; try a lower optimizer.lr)",
                 skipped_in_a_row_, m.step, t.max_skipped_steps);
    if (m.step % config_.logging.log_interval == 0 || m.step == 1 || m.step == t.steps)
      log_line(format_step(m, t.steps) + (m.op_seconds ? "\n" + format_op_seconds(m) : ""));
    // The first step plans nearly every GEMM shape the run has (NOTE [GEMM tuning cache]).
    if (step == start_step_ && t.gemm_tuning && device_ == Device::CUDA)
      log_line(describe_gemm_tuning(gemm_tuning_stats()));
    if (progress) progress->update(static_cast<double>(m.step), fmt::format("loss {:.4f}, {:.0f} tokens/s", m.loss, m.tokens_per_s));

    const int64_t samples = m.step * samples_per_step;
    if (observer_) observer_->step_done(m, samples);
    bool eval_now = config_.eval.interval > 0 && (m.step % config_.eval.interval == 0 || m.step == t.steps);
    if (observer_ && eval_data_) eval_now = observer_->evaluation_due(m.step, samples, eval_now);
    if (eval_now) {
      if (observer_) observer_->evaluation_begins(samples);
      EvalMetrics e = evaluate(m.step);
      if (fp8_) fp8_->discard_amaxes();  // NOTE [FP8 step end]: the validation data stays out of the histories
      if (metrics_) metrics_->write(e);
      result.evals.push_back(e);
      log_line(format_eval(e, result.entropy_floor));
      if (observer_ && observer_->evaluation_done(e, samples)) {
        result.stopped_by_observer = true;
        log_line(fmt::format("training ends after step {}: the evaluation reached the run's target", m.step));
      }
    }
    const CheckpointConfig& ckpt = config_.checkpoint;
    if (ckpt.enable &&
        (m.step % ckpt.interval == 0 || m.step == t.steps || stop_now || result.stopped_by_observer)) {
      if (progress) progress->clear();
      save_checkpoint(m.step);
    }
    if (stop_now && m.step < t.steps) {
      const int sig = stop_signal();
      log_warn("stopped by {} after step {}{} (exit status {}); the same command resumes the run", 
               sig ? fmt::format("SIG{}", sigabbrev_np(sig)) : std::string("a signal to another rank"), m.step,
               ckpt.enable ? ", checkpoint saved" : ", nothing saved (checkpoint.enable is false)", kExitStopped);
      result.stopped = true;
      break;
    }
    if (result.stopped_by_observer) break;
  }
  if (progress) progress->clear();
  if (observer_)
    observer_->training_ends(static_cast<int64_t>(result.losses.size() + start_step_) * samples_per_step,
                             result.stopped_by_observer);
  finish_checkpoint_save_job();  // the last save is on disk before the run ends (NOTE [Async checkpoints])
  result.loss_spikes = static_cast<int64_t>(loss_spike_steps_.size());
  if (loss_spike_.enabled()) {
    std::string steps;  // the first 20
    for (size_t i = 0; i < loss_spike_steps_.size() && i < 20; ++i)
      steps += fmt::format("{}{}", i ? ", " : "", loss_spike_steps_[i]);
    if (loss_spike_steps_.size() > 20) steps += ", ...";
    log_info("loss spikes: {}{} (training.loss_spike_factor {}, on_loss_spike {})", loss_spike_steps_.size(),
             steps.empty() ? "" : fmt::format(" at step{} {}", loss_spike_steps_.size() == 1 ? "" : "s", steps),
             t.loss_spike_factor, t.on_loss_spike);
  }
  if (result.stopped) return result;
  if (hf_export_done_) log_info("the Hugging Face export '{}/hf' of this finished run is already there", run_dir_);
  else if (config_.checkpoint.last_save_in_hf) export_hf_model();
  if (lora_) save_peft_adapter_to_run_dir();
  return result;
}

}  // namespace forge
