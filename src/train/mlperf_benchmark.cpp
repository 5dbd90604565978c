#include "train/mlperf_benchmark.h"

#include <fmt/format.h>

#include <cmath>
#include <map>
#include <optional>

#include "core/error.h"

namespace forge::mlperf {
namespace {

// The hyperparameters of the RCPs (rcp_checker/training_5.1.0/rcps_*.json, "Hyperparams"):
// base LR and warm-up samples (8B) at each global batch the references converged at.
struct RcpHyperparameters {
  double lr;
  int64_t warmup_samples;
};

const std::map<int64_t, RcpHyperparameters>& rcp_hyperparameters(const Benchmark& b) {
  static const std::map<int64_t, RcpHyperparameters> llama31_8b = {
      {16, {4e-4, 256}}, {32, {8e-4, 4096}}, {64, {8e-4, 6144}}, {96, {1e-3, 16348}}, {128, {2e-3, 32768}}};
  static const std::map<int64_t, RcpHyperparameters> llama2_70b_lora = {
      {8, {4e-4, 0}}, {16, {4e-4, 0}}, {32, {4e-4, 0}}, {128, {1e-3, 0}}};
  // rcps_flux1.json gives warm-up steps: 1,600 at 512 and 100 at 4,096, kept here as samples.
  static const std::map<int64_t, RcpHyperparameters> flux1 = {
      {512, {2e-4, 1600 * 512}}, {1024, {2e-4, 0}}, {2048, {2.5e-4, 0}}, {4096, {4e-4, 100 * 4096}}};
  return b.flux ? flux1 : b.lora ? llama2_70b_lora : llama31_8b;
}

constexpr int64_t kLlama31MaxSteps = 1'200'000;  // the rules' max_steps: the cosine's length
constexpr int64_t kLoraTrainingSteps = 1024;     // run_llama_70B_scrolls_r16.sh --max_steps
// Flux.1 has no max_steps: a run that has not converged stops after this many images,
// about 2x the slowest RCP's (15.6 M at batch 4,096); training.steps overrides it.
constexpr int64_t kFluxMaxSamples = 32'000'000;

bool has_prefix(const std::string& key, std::initializer_list<const char*> prefixes) {
  for (const char* p : prefixes)
    if (key.starts_with(p)) return true;
  return false;
}

int64_t parse_count(const std::string& key, const std::string& value) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || v < 1)
    FORGE_FAIL("--{} '{}' (command line): expected a positive integer", key, value);
  return v;
}

double parse_number(const std::string& key, const std::string& value) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || !std::isfinite(v) || v <= 0)
    FORGE_FAIL("--{} '{}' (command line): expected a positive number", key, value);
  return v;
}

std::string number(double v) { return fmt::format("{}", v); }

}  // namespace

const Benchmark& benchmark(const std::string& name) {
  static const Benchmark llama31_8b{"llama31_8b", "llama3.1-8b", 3.3, "log perplexity", 12288, 1024, 32, false};
  static const Benchmark llama2_70b_lora{"llama2_70b_lora", "llama2-70b", 0.925, "evaluation loss", 384, 173, 8, true};
  static const Benchmark flux1{"flux1", "flux1-schnell", 0.586, "validation loss", 262144, 29696, 512, false, true};
  if (name == llama31_8b.name) return llama31_8b;
  if (name == llama2_70b_lora.name) return llama2_70b_lora;
  if (name == flux1.name) return flux1;
  FORGE_FAIL("MLPerf benchmark '{}': forge runs llama31_8b, llama2_70b_lora and flux1", name);
}

std::vector<std::string> benchmark_names() { return {"llama31_8b", "llama2_70b_lora", "flux1"}; }

int64_t skipped_evaluations(const Benchmark& b, int64_t global_batch) {
  // training_rules.adoc, "Quality measure": LoRA skips FLOOR(0.125 * global_batch_size + 2).
  return b.lora ? static_cast<int64_t>(std::floor(0.125 * static_cast<double>(global_batch) + 2.0)) : 0;
}

int64_t eval_interval_steps(const Benchmark& b, int64_t global_batch) {
  return (b.eval_interval_samples + global_batch - 1) / global_batch;
}

namespace {

// NOTE [MLPerf reference settings] for flux1.
KeyRole flux_key_role(const std::string& key) {
  if (key == "training.global_batch_size" || key == "optimizer.lr" || key == "lr_scheduler.warmup_steps" ||
      key == "training.gradient_accumulation_steps")
    return KeyRole::Hyperparameter;
  if (has_prefix(key, {"precision.", "activation_checkpoint.", "parallelism."}) || key == "training.steps" ||
      key == "training.local_batch_size" || key == "training.device" || key == "training.gemm_tuning" ||
      key == "training.gemm_tuning_cache" || key == "flux.data_path" || key == "flux.eval_data_path" ||
      key == "checkpoint.buffer_mb" || key == "logging.log_interval" || key == "logging.profile_ops" ||
      key == "logging.enable_tensorboard")
    return KeyRole::System;
  if (key == "flux.model" || key == "flux.num_double_blocks" || key == "flux.num_single_blocks" ||
      key == "flux.resolution" || key == "flux.text_tokens")
    return KeyRole::NotBenchmark;
  return KeyRole::Reference;
}

}  // namespace

KeyRole key_role(const Benchmark& b, const std::string& key) {
  if (b.flux) return flux_key_role(key);
  if (key == "training.global_batch_size" || key == "optimizer.lr" || key == "lr_scheduler.warmup_steps" ||
      key == "training.gradient_accumulation_steps")
    return KeyRole::Hyperparameter;
  // LoRA: opt_learning_rate_training_steps, the cosine's length, is the submitter's; it is
  // also where the reference stops (max_steps). 8B: the cosine is fixed at 1.2 M steps and
  // training.steps only bounds a run that does not converge.
  if (key == "training.steps") return b.lora ? KeyRole::Hyperparameter : KeyRole::System;
  if (has_prefix(key, {"precision.", "activation_checkpoint.", "parallelism."}) ||
      key == "training.local_batch_size" || key == "training.device" || key == "training.gemm_tuning" ||
      key == "training.gemm_tuning_cache" || key == "training.on_nonfinite" || key == "training.max_skipped_steps" ||
      key == "optimizer.state_dtype" || key == "data.path" || key == "checkpoint.buffer_mb" ||
      key == "logging.log_interval" || key == "logging.profile_ops" || key == "logging.enable_tensorboard")
    return KeyRole::System;
  if (!b.lora && key == "data.validation_path") return KeyRole::System;
  if (b.lora && key == "checkpoint.initial_load_path") return KeyRole::System;
  if (has_prefix(key, {"model."}) || key == "training.seq_len" || key == "data.source" || key == "data.num_samples" ||
      key == "data.synthetic_order" || key == "data.synthetic_concentration")
    return KeyRole::NotBenchmark;
  return KeyRole::Reference;
}

RunPlan plan_run(const Benchmark& b, const KeyValues& user) {
  RunPlan plan;
  std::map<std::string, std::string> given;
  for (const auto& [key, value] : user) {
    switch (key_role(b, key)) {
      case KeyRole::Reference:
        FORGE_FAIL("--{} (command line): {} fixes it (NOTE [MLPerf reference settings]; the MLPerf training "
                   "rules' hyperparameter table allows a closed submission to choose only the global batch, base "
                   "LR, warm-up, gradient accumulation{}); forge mlperf {} accepts those, the system settings "
                   "(device, micro-batch, precision, activation checkpointing, parallelism, data paths) and, for "
                   "smoke tests, {}",
                   key, b.name, b.lora ? " and the schedule's training steps" : "", b.name,
                   b.flux ? "flux.model, flux.num_double_blocks, flux.num_single_blocks, flux.resolution and "
                            "flux.text_tokens"
                          : "model.*, training.seq_len and data.source");
      case KeyRole::NotBenchmark:
        plan.not_benchmark.push_back(fmt::format("{} {}", key, value));
        break;
      case KeyRole::Hyperparameter:
      case KeyRole::System:
        break;
    }
    given[key] = value;
  }

  plan.global_batch = given.count("training.global_batch_size")
                          ? parse_count("training.global_batch_size", given["training.global_batch_size"])
                          : b.reference_batch;
  plan.local_batch = given.count("training.local_batch_size")
                         ? parse_count("training.local_batch_size", given["training.local_batch_size"])
                         : 1;
  const auto& rcps = rcp_hyperparameters(b);
  const auto rcp = rcps.find(plan.global_batch);
  if (rcp == rcps.end() && (!given.count("optimizer.lr") || (!b.lora && !given.count("lr_scheduler.warmup_steps")))) {
    std::string batches;
    for (const auto& [batch, h] : rcps) batches += fmt::format("{}{}", batches.empty() ? "" : ", ", batch);
    FORGE_FAIL("--training.global_batch_size {} (command line): no {} RCP was measured at that batch (they were at {}),"
               " so there is no reference base LR{} for it: give --optimizer.lr{} too",
               plan.global_batch, b.name, batches, b.lora ? "" : " and warm-up",
               b.lora ? "" : " and --lr_scheduler.warmup_steps");
  }
  const double lr = given.count("optimizer.lr") ? parse_number("optimizer.lr", given["optimizer.lr"]) : rcp->second.lr;
  int64_t warmup_steps = 0;
  if (given.count("lr_scheduler.warmup_steps")) {
    const std::string& v = given["lr_scheduler.warmup_steps"];
    warmup_steps = v == "0" ? 0 : parse_count("lr_scheduler.warmup_steps", v);
  } else if (!b.lora) {
    warmup_steps = (rcp->second.warmup_samples + plan.global_batch - 1) / plan.global_batch;
  }
  if (b.lora && plan.local_batch != 1)
    FORGE_FAIL("--training.local_batch_size {} (command line): {} evaluates its {} sequences one per micro-batch "
               "(the reference's per_device_eval_batch_size 1, whose eval_loss is the mean of the sequences' "
               "means), so the micro-batch must be 1",
               plan.local_batch, b.name, b.eval_samples);
  if (b.eval_samples % plan.local_batch != 0)
    FORGE_FAIL("--training.local_batch_size {} (command line): {} evaluates {} sequences, a whole number of "
               "micro-batches: the micro-batch must divide {}",
               plan.local_batch, b.name, b.eval_samples, b.eval_samples);

  KeyValues& o = plan.overrides;
  o = {{b.flux ? "flux.model" : "model.name", b.model},
       {"training.global_batch_size", std::to_string(plan.global_batch)},
       {"training.local_batch_size", std::to_string(plan.local_batch)},
       {"training.device", "cuda"},
       {"precision.compute_dtype", "bf16"},
       {"optimizer.name", "adamw"},
       {"optimizer.lr", number(lr)},
       {"lr_scheduler.warmup_steps", std::to_string(warmup_steps)},
       {"lr_scheduler.decay_style", b.flux ? "constant" : "cosine"},
       {"eval.interval", std::to_string(eval_interval_steps(b, plan.global_batch))},
       {"eval.steps", std::to_string(b.eval_samples / plan.local_batch)},
       {"checkpoint.enable", "false"}};
  if (b.flux) {
    // NOTE [MLPerf Flux.1].
    KeyValues more = {{"flux.resolution", "256"},
                      {"flux.text_tokens", "256"},
                      {"flux.timestep_sampling", "uniform"},
                      {"flux.timestep_shift", "none"},
                      {"flux.weight_init", "torchtitan"},
                      {"flux.caption_dropout_prob", "0.1"},
                      {"training.steps", std::to_string((kFluxMaxSamples + plan.global_batch - 1) / plan.global_batch)},
                      {"training.max_norm", "1.0"},
                      {"optimizer.beta1", "0.9"},
                      {"optimizer.beta2", "0.95"},
                      {"optimizer.eps", "1e-08"},
                      {"optimizer.weight_decay", "0.1"}};
    o.insert(o.end(), more.begin(), more.end());
  } else if (!b.lora) {
    // pretrain_llama31.py: distributed_fused_adam_with_cosine_annealing (betas 0.9/0.95, eps
    // 1e-5, weight decay 0.1, clip 1.0), min_lr = 0.1 × max_lr, max_steps 1.2 M; seq 8192.
    KeyValues more = {{"training.seq_len", "8192"},
                      {"training.steps", std::to_string(kLlama31MaxSteps)},
                      {"training.max_norm", "1.0"},
                      {"optimizer.beta1", "0.9"},
                      {"optimizer.beta2", "0.95"},
                      {"optimizer.eps", "1e-05"},
                      {"optimizer.weight_decay", "0.1"},
                      {"lr_scheduler.decay_steps", std::to_string(kLlama31MaxSteps - warmup_steps)},
                      {"lr_scheduler.min_lr", number(0.1 * lr)},
                      {"data.source", "indexed"},
                      {"eval.average", "tokens"}};
    o.insert(o.end(), more.begin(), more.end());
  } else {
    // run_llama_70B_scrolls_r16.sh: HF Trainer, adamw_torch (betas 0.9/0.999, eps 1e-8),
    // weight decay 1e-4, clip 0.3, cosine over max_steps 1024 without warm-up to 0, LoRA
    // r 16, alpha 32, dropout 0.1 on the fused qkv and o projections; GovReport blocks of
    // 8,192 tokens (8,191 predictions).
    KeyValues more = {{"training.seq_len", "8191"},
                      // Llama 2's config.json says 4,096 positions; the reference trains at 8,192 (RoPE unscaled).
                      {"training.allow_longer_seq_len", "true"},
                      {"training.steps", std::to_string(kLoraTrainingSteps)},
                      {"training.max_norm", "0.3"},
                      {"optimizer.beta1", "0.9"},
                      {"optimizer.beta2", "0.999"},
                      {"optimizer.eps", "1e-08"},
                      {"optimizer.weight_decay", "0.0001"},
                      {"lr_scheduler.decay_steps", "0"},
                      {"lr_scheduler.min_lr", "0"},
                      {"lora.rank", "16"},
                      {"lora.alpha", "32"},
                      {"lora.dropout", "0.1"},
                      {"lora.target_modules", "qkv_proj,o_proj"},
                      {"activation_checkpoint.mode", "full"},
                      {"data.source", "govreport_npy"},
                      {"eval.average", "micro_batches"}};
    o.insert(o.end(), more.begin(), more.end());
    if (given.count("checkpoint.initial_load_path")) o.emplace_back("checkpoint.initial_load_in_hf", "true");
  }
  for (const auto& [key, value] : user) {
    if (key_role(b, key) == KeyRole::Hyperparameter)
      plan.hyperparameters.push_back(fmt::format("{} {}", key, value));
    if (key == "training.global_batch_size" || key == "training.local_batch_size" || key == "optimizer.lr" ||
        key == "lr_scheduler.warmup_steps")
      continue;  // already in the plan, with what it implies
    o.emplace_back(key, value);
  }
  return plan;
}

}  // namespace forge::mlperf
