#include "train/memory_check.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/device.h"
#include "core/error.h"
#include "core/host_memory.h"
#include "distributed/launch_env.h"
#include "model/pipeline.h"

namespace forge {

MemoryPlan memory_plan_of(const ExperimentConfig& config) {
  MemoryPlan plan;
  plan.micro_batch = config.training.local_batch_size;
  plan.seq_len = config.training.seq_len;
  plan.cuda = config.training.device == "cuda";
  plan.optimizer_state = config.optimizer.state_dtype == "bf16" ? DType::BF16 : DType::F32;
  plan.checkpoint = activation_checkpoint_from_name(config.activation_checkpoint.mode);
  const ParallelismConfig& p = config.parallelism;
  // NOTE [Context-parallel steps]: FSDP shards over the context-parallel ranks too.
  plan.fsdp = p.data_parallel_shard_degree * p.data_parallel_replicate_degree * p.context_parallel_degree > 1;
  plan.shard_ranks = p.data_parallel_shard_degree * p.context_parallel_degree;
  plan.zero_stage = p.zero_stage;
  plan.expert_parallel = p.expert_parallel_degree;
  plan.tensor_parallel = p.tensor_parallel_degree;
  plan.context_parallel = p.context_parallel_degree;
  plan.context_parallel_rotate = parse_context_parallel_rotate(p.context_parallel_rotate_method);
  plan.pipeline_parallel = p.pipeline_parallel_degree;
  if (p.pipeline_parallel_degree > 1)
    plan.pipeline_virtual_stages = pipeline_virtual_stages(config.model, p.pipeline_parallel_degree,
                                                           p.pipeline_parallel_layers_per_stage,
                                                           parse_pipeline_schedule(p.pipeline_parallel_schedule));
  plan.bf16_reduce = config.precision.reduce_dtype == "bf16";
  plan.micro_batches = config.training.gradient_accumulation_steps;
  plan.lora = config.lora;
  plan.fp8 = fp8_settings_of(config);
  plan.fp8_all_gather = config.precision.fp8_fsdp_all_gather;
  return plan;
}

std::optional<Fp8Settings> fp8_settings_of(const ExperimentConfig& config) {
  const PrecisionConfig& p = config.precision;
  if (p.fp8 == "none") return std::nullopt;
  Fp8Settings s;
  s.recipe = p.fp8 == "delayed" ? Fp8Recipe::Delayed : Fp8Recipe::Tensorwise;
  s.grad_format = p.fp8_grad_format == "e4m3" ? Fp8Format::E4M3 : Fp8Format::E5M2;
  s.output_head = p.fp8_output_head;
  s.routed_experts = p.fp8_routed_experts;  // NOTE [FP8 routed experts switch] in model/fp8_projections.h
  s.weight_gradient = p.fp8_weight_gradient;  // NOTE [FP8 weight gradient switch] in ops/fp8_linear.h
  s.filter_fqns = fp8_filter_fqns_of(p.fp8_filter_fqns);  // NOTE [FP8 filter] in model/fp8_projections.h
  s.amax_history_length = p.fp8_amax_history_len;
  s.amax_algorithm = p.fp8_amax_compute_algo == "most_recent" ? cpu::Fp8AmaxAlgorithm::MostRecent
                                                              : cpu::Fp8AmaxAlgorithm::Max;
  s.margin = static_cast<float>(p.fp8_margin);
  // The FP8 all-gather brings the blocks' codes ready to use (NOTE [FP8 all-gather]): no cache.
  // Nor under QLoRA: a cache of the base's codes would hold 2 bytes per weight, four times
  // its NF4 codes (NOTE [FP8 over an NF4 base] in model/nf4_base.cpp).
  s.weight_cache = p.fp8_weight_cache && !p.fp8_fsdp_all_gather && config.lora.quantize_base == "none";
  s.frozen = config.lora.enabled();
  s.expert_parallel = config.parallelism.expert_parallel_degree;  // NOTE [FP8 routed experts under expert parallelism]
  return s;
}

std::string fp8_recipe_description(const PrecisionConfig& p) {
  if (p.fp8 != "delayed") return p.fp8;
  return fmt::format("delayed (amax history {}, {}, margin {})", p.fp8_amax_history_len, p.fp8_amax_compute_algo,
                     p.fp8_margin);
}

namespace {

// NOTE [The memory check on the CPU]
// The CPU reference path allocates the same weights, gradients, AdamW state and activation
// arena from host memory, so an absurd training.seq_len or local_batch_size would otherwise
// go on to allocate (and swap, or be killed) instead of failing. The check runs before the
// first allocation as on CUDA, against what the host has available (its cgroup limit
// included), counting every rank this node starts: they share the host's memory.
void check_host_memory_fits(const ExperimentConfig& config, const MemoryPlan& plan) {
  const MemoryEstimate need = estimate_memory(config.model, plan);
  const int ranks_here = std::max(read_launch_env().local_world_size, 1);
  const HostMemoryInfo host = host_memory_info();
  const double needed = need.total() * ranks_here;
  if (needed <= static_cast<double>(host.available)) return;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  throw OutOfMemoryError(fmt::format(
      "{} (micro-batch {}, seq {}, activation_checkpoint.mode {}) does not fit in host memory on the CPU path: it "
      "needs an estimated {}{}, and {:.2f} GiB of {:.2f} GiB are available. Try a smaller training.seq_len or "
      "training.local_batch_size, activation_checkpoint.mode full, or a smaller model",
      config.model.name, plan.micro_batch, plan.seq_len, activation_checkpoint_name(plan.checkpoint),
      describe(need, false), ranks_here > 1 ? fmt::format(" per rank × {} ranks on this node", ranks_here) : "",
      static_cast<double>(host.available) / gib, static_cast<double>(host.total) / gib));
}

}  // namespace

void check_memory_fits(const ExperimentConfig& config) {
  const MemoryPlan plan = memory_plan_of(config);
  if (!plan.cuda) return check_host_memory_fits(config, plan);
  const MemoryEstimate need = estimate_memory(config.model, plan);
  const DeviceMemoryInfo gpu = device_memory_info();
  if (need.total() + kReserveBytes <= static_cast<double>(gpu.free)) return;

  std::string hints;
  if (plan.checkpoint != ActivationCheckpoint::Full) hints += ", activation_checkpoint.mode full";
  if (plan.optimizer_state != DType::BF16) hints += ", optimizer.state_dtype bf16";
  if (plan.micro_batch > 1) hints += ", a smaller training.local_batch_size";
  // Under pipelining too, with FP8 and LoRA with expert parallelism (NOTE [ZeRO-2 and -3
  // under pipeline parallelism] in distributed/fsdp.h).
  if (plan.fsdp && plan.zero_stage < 3) hints += ", parallelism.zero_stage 3";
  // Under FSDP the cache holds every FP8 weight in full; the FP8 all-gather brings the blocks'
  // codes with each gather instead (NOTE [FP8 all-gather], of a frozen base too).
  if (need.fp8_weight_cache > 0 && plan.fsdp && !plan.fp8_all_gather && config.lora.quantize_base == "none")
    hints += ", precision.fp8_fsdp_all_gather true";
  if (need.fp8_weight_cache > 0) hints += ", precision.fp8_weight_cache false";
  hints += ", or more GPUs (FSDP shards weights, gradients and optimizer state)";
  const double gib = 1024.0 * 1024.0 * 1024.0;
  throw OutOfMemoryError(fmt::format(
      "{} (micro-batch {}, seq {}, activation_checkpoint.mode {}, optimizer.state_dtype {}) does not fit on {}: it "
      "needs an estimated {} plus {:.1f} GiB for the CUDA context and library workspaces, and {:.2f} GiB of {:.2f} "
      "GiB are free. Try{}",
      config.model.name, plan.micro_batch, plan.seq_len, activation_checkpoint_name(plan.checkpoint),
      config.optimizer.state_dtype, accelerator_name(), describe(need), kReserveBytes / gib,
      static_cast<double>(gpu.free) / gib, static_cast<double>(gpu.total) / gib, hints.substr(1)));
}

}  // namespace forge
