#include "distributed/launch_env.h"
#include "cli/commands.h"
#include "cli/flux_info.h"
#include "train/flux_trainer.h"

#include <fmt/ranges.h>

#include <filesystem>
#include <map>

#include "ckpt/hf_weight_files.h"
#include "ckpt/initial_load.h"
#include "cli/config.h"
#include "core/log.h"
#include "core/stop_signal.h"
#include "model/lora.h"
#include "model/nf4_base.h"
#include "model/tensor_parallel.h"
#include "train/memory_check.h"
#include "train/trainer.h"

namespace forge {
namespace {

// Splits "[FILE] [--section.key VALUE ...]": an optional leading positional argument,
// then overrides.
struct Invocation {
  std::string positional;
  std::vector<std::pair<std::string, std::string>> overrides;
};

Invocation parse_invocation(const std::vector<std::string>& args, const char* command) {
  Invocation inv;
  size_t first = 0;
  if (!args.empty() && !args[0].starts_with("--")) {
    inv.positional = args[0];
    first = 1;
  }
  std::vector<std::string> rest(args.begin() + static_cast<std::ptrdiff_t>(first), args.end());
  if (!rest.empty() && !rest.front().starts_with("--"))
    FORGE_FAIL("forge {}: unexpected argument '{}': give at most one file, then --section.key VALUE overrides",
               command, rest.front());
  inv.overrides = parse_overrides(rest);
  return inv;
}

std::string architecture_summary(const ModelConfig& m) {
  const std::string attention =
      m.mla() ? fmt::format("{} heads of Multi-head Latent Attention (q {}, kv rank {}, qk head dim {} + {} rotary, v "
                            "head dim {})",
                            m.num_heads, m.q_lora_rank > 0 ? fmt::format("rank {}", m.q_lora_rank) : "uncompressed",
                            m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
              : fmt::format("{} heads / {} kv heads (head dim {})", m.num_heads, m.num_kv_heads, m.resolved_head_dim());
  std::string mlp = fmt::format("ffn {}", m.ffn_hidden_size);
  if (m.moe()) {
    mlp = fmt::format("{} experts of ffn {}, top-{} ({} scores{}{}{})", m.num_experts, m.resolved_moe_ffn(),
                      m.num_experts_per_tok, m.router_score_function,
                      m.router_num_groups > 1
                          ? fmt::format(", best {} of {} groups", m.router_topk_groups, m.router_num_groups)
                          : "",
                      m.router_normalize_topk ? ", renormalized" : "",
                      m.router_scaling_factor != 1.0 ? fmt::format(", x {}", m.router_scaling_factor) : "");
    if (m.num_shared_experts > 0) mlp += fmt::format(" + {} shared", m.num_shared_experts);
    if (m.moe_capacity_factor > 0)
      mlp += fmt::format(", capacity factor {} (drops by {}{})", m.moe_capacity_factor, m.moe_token_drop_policy,
                         m.moe_pad_to_capacity ? ", padded to capacity" : "");
    if (m.first_dense_layers > 0) mlp += fmt::format(", the first {} blocks dense (ffn {})", m.first_dense_layers, m.ffn_hidden_size);
  }
  return fmt::format("{} layers, hidden {}, {}, {}, vocab {}{}{}{}", m.num_layers, m.hidden_size, attention, mlp,
                     m.vocab_size, m.tie_word_embeddings ? ", tied embeddings" : "",
                     m.sliding_window ? fmt::format(", sliding window {}", m.sliding_window) : "",
                     m.rope_scaling.yarn() ? fmt::format(", YaRN RoPE x{}", m.rope_scaling.factor) : "");
}

// The config of a run that starts from the Hugging Face model in `dir`.
ExperimentConfig hf_experiment(const std::string& dir, ConfigOverrides overrides) {
  // Absolute, so the printed config runs from any directory. A directory without
  // config.json fails naming it ("DIR/config.json: not found (is 'DIR' a Hugging Face ...?)").
  const std::string path = std::filesystem::absolute(dir).lexically_normal().string();
  overrides.insert(overrides.begin(), {{"checkpoint.initial_load_path", path}, {"checkpoint.initial_load_in_hf", "true"}});
  return load_experiment("", overrides);
}

void print_implied_yaml(const ExperimentConfig& config, const std::string& dir) {
  fmt::print("# The config a run from {} implies, as `forge train FILE` accepts it. config.json sets every\n"
             "# model key (drop them or keep them: a different value is refused); checkpoint.initial_load_path\n"
             "# is the only key a run from it needs.\n{}",
             dir, to_yaml(config));
}

}  // namespace

int run_train(const std::vector<std::string>& args) {
  Invocation inv = parse_invocation(args, "train");
  ExperimentConfig config = load_experiment(inv.positional, inv.overrides);
  std::string yaml = to_yaml(config);
  if (read_launch_env().rank == 0) log_info("forge {} | resolved config:\n{}", FORGE_VERSION, yaml);
  install_stop_signal_handlers();  // NOTE [Stop signals]
  if (!config.flux.model.empty()) {  // NOTE [FLUX runs]
    const FluxTrainResult result = FluxTrainer(config, yaml).run();
    if (result.stopped) return kExitStopped;
    if (result.losses.empty()) log_info("done: no steps left to train");
    else log_info("done: {} steps, final loss {:.4f}", result.losses.size(), result.losses.back());
    return 0;
  }
  Trainer trainer(config, yaml);
  TrainResult result = trainer.run();
  if (result.stopped) return kExitStopped;
  if (!result.evals.empty() && result.entropy_floor > 0) {
    const EvalMetrics& last = result.evals.back();
    log_info("done: validation loss {:.4f} nats/token, entropy floor {:.4f}, gap {:.4f} ({:.1f}% above the floor)",
             last.loss, result.entropy_floor, last.loss - result.entropy_floor,
             100.0 * (last.loss - result.entropy_floor) / result.entropy_floor);
  } else if (!result.evals.empty()) {
    log_info("done: validation loss {:.4f}, perplexity {:.3f}", result.evals.back().loss, result.evals.back().perplexity);
  }
  log_info("metrics: {}/metrics.jsonl", result.run_dir);
  return 0;
}

int run_info(const std::vector<std::string>& args) {
  Invocation inv = parse_invocation(args, "info");
  if (inv.positional.empty()) FORGE_FAIL("forge info: give a model name (e.g. llama3.1-8b) or an experiment file");
  if (is_flux_preset(inv.positional)) return run_flux_info(inv.positional, inv.overrides);
  std::string experiment;
  std::error_code error;
  const bool hf_dir = std::filesystem::is_directory(inv.positional, error) &&
                      classify_initial_load(inv.positional, "forge info") == InitialLoadKind::HuggingFace;
  if (hf_dir) {
    inv.overrides.insert(inv.overrides.begin(),
                         {"checkpoint.initial_load_path", std::filesystem::absolute(inv.positional).lexically_normal().string()});
  } else if (std::filesystem::exists(inv.positional, error)) {  // load_experiment refuses what is not a regular file
    experiment = inv.positional;
  } else if (inv.positional.ends_with(".yaml") || inv.positional.ends_with(".yml")) {
    FORGE_FAIL("experiment file '{}' not found", inv.positional);
  } else {
    inv.overrides.insert(inv.overrides.begin(), {"model.name", inv.positional});
  }
  ExperimentConfig config = load_experiment(experiment, inv.overrides);
  const ModelConfig& m = config.model;
  const TrainingConfig& t = config.training;
  fmt::print("model            {}\n", m.name);
  fmt::print("architecture     {}\n", architecture_summary(m));
  fmt::print("parameters       {:.2f} B ({} total; {} without the input embedding)\n", m.total_params() / 1e9,
             m.total_params(), m.total_params() - m.embedding_params());
  if (m.moe())
    fmt::print("active params    {:.2f} B per token ({}: the router{} and {} of the {} routed experts of each MoE "
               "block)\n",
               m.active_params() / 1e9, m.active_params(), m.num_shared_experts > 0 ? ", the shared experts" : "",
               m.num_experts_per_tok, m.num_experts);
  fmt::print("FLOPs per token  {:.3e} at seq_len {} (6 x ({}params - embedding) + 6 x layers x {} x seq)\n",
             m.flops_per_token(t.seq_len), t.seq_len, m.moe() ? "active " : "",
             m.mla() ? "heads x (qk + v head dims) / 2" : "hidden");
  if (config.lora.enabled()) {
    const LoraSizes lora = lora_sizes(m, config.lora, 1);
    fmt::print("LoRA             rank {}, alpha {} on {}: {} trainable parameters ({:.3f}% of the model's), the "
               "model's frozen\n",
               config.lora.rank, config.lora.alpha, config.lora.target_modules, lora.trainable,
               100.0 * static_cast<double>(lora.trainable) / static_cast<double>(m.total_params()));
    fmt::print("LoRA FLOPs/token {:.3e} (4 x frozen + 6 x adapter params + attention; NOTE [LoRA FLOPs])\n",
               training_flops_per_token(m, config.lora, t.seq_len));
  }
  if (config.lora.quantize_base == "nf4") {
    int64_t projections = 0;
    for (const ParamSpec& spec : parameter_specs(m))
      if (is_quantized_base_weight(spec)) projections += shape_numel(spec.shape);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    fmt::print("QLoRA            {} block projection (and routed expert) weights in NF4: {:.2f} GiB of codes and statistics ({:.3f} byte "
               "per weight), dequantized per layer into a scratch of {:.2f} GiB (bf16 on a GPU)\n",
               projections, nf4_base_bytes(m) / gib, nf4_base_bytes(m) / static_cast<double>(projections),
               nf4_scratch_bytes(m, DType::BF16) / gib);
    if (const int64_t ep = config.parallelism.expert_parallel_degree; ep > 1) {
      // NOTE [NF4 expert stacks under expert parallelism]
      const std::vector<ParamSpec> held = expert_parallel_specs(parameter_specs(m), {0, ep});
      fmt::print("                 expert parallelism {}: a rank holds {:.2f} GiB of them (its {} of the {} routed "
                 "experts' codes, the rest replicated), its scratch {:.2f} GiB\n",
                 ep, nf4_base_bytes(m, held) / gib, m.num_experts / ep, m.num_experts,
                 nf4_scratch_bytes(m, DType::BF16, true, held) / gib);
    }
    if (const int64_t tp = config.parallelism.tensor_parallel_degree; tp > 1) {
      // NOTE [NF4 base under tensor parallelism]
      const std::vector<ParamSpec> shards = parameter_specs(m, {0, static_cast<int>(tp)});
      fmt::print("                 tensor parallelism {}: a rank holds {:.2f} GiB of them (the codes of its shards, "
                 "each quantized on its own), its scratch {:.2f} GiB\n",
                 tp, nf4_base_bytes(m, shards) / gib, nf4_scratch_bytes(m, DType::BF16, true, shards) / gib);
    }
  }
  if (const std::optional<Fp8Settings> fp8 = fp8_settings_of(config)) {
    // Under LoRA (NOTE [FP8 frozen base]) the frozen base has no weight gradient: 4 FLOPs
    // per weight in FP8, of NOTE [LoRA FLOPs]'s count; as many when the weight gradients run
    // in bf16 (NOTE [FP8 weight gradient switch] in ops/fp8_linear.h).
    const PrecisionConfig& p = config.precision;
    const bool fp8_weight_gradient = fp8_weight_gradients(*fp8);
    const double share = (fp8_weight_gradient ? 6.0 : 4.0) * static_cast<double>(fp8_gemm_params(m, *fp8)) /
                         training_flops_per_token(m, config.lora, t.seq_len);
    // NOTE [FP8 all-gather pieces]: the FP8 all-gather's pieces of one scale each.
    const bool expert_pieces = m.moe() && fp8->routed_experts && config.parallelism.expert_parallel_degree == 1;
    fmt::print("FP8              {}: the {} {}{} in FP8 ({:.1f}% of the FLOPs per "
               "token), activations and weights e4m3, gradients {}; the output head {}, {}embedding, attention, "
               "norms and optimizer in bf16/fp32; weights cast {}{}\n",
               fp8_recipe_description(p),
               fp8->frozen ? "forward and input-gradient GEMMs of the frozen"
               : fp8_weight_gradient
                   ? "forward, input- and weight-gradient GEMMs of"
                   : "forward and input-gradient GEMMs (the weight gradients in bf16: precision.fp8_weight_gradient "
                     "false) of",
               // NOTE [FP8 routed experts switch] in model/fp8_projections.h
               !m.moe() ? "qkv, o, gate/up and down"
               : fp8->routed_experts
                   ? "block projections and routed experts (each expert its own scales; the router in bf16)"
                   : "block projections (the routed experts and the router in bf16: precision.fp8_routed_experts "
                     "false)",
               fp8->output_head ? " and of the output head" : "", 100.0 * share, p.fp8_grad_format,
               fp8->output_head ? "in FP8" : "in bf16", fp8->frozen ? "LoRA adapters, " : "",
               p.fp8_fsdp_all_gather ? "by each rank from its master chunk before the gathers"
               // NOTE [FP8 over an NF4 base]: no cache of the base's codes.
               : config.lora.quantize_base == "nf4"
                   ? "in every GEMM from the NF4 codes (on CUDA straight to E4M3, on the CPU through their fp32 "
                     "values; QLoRA keeps no FP8 copy of the base: precision.fp8_weight_cache does not apply)"
               : !p.fp8_weight_cache || t.device != "cuda" ? "in every micro-batch"
               // NOTE [FP8 frozen routed experts]: a delayed run casts a frozen expert once per step.
               : fp8->frozen ? (m.moe() && fp8->routed_experts && fp8->recipe == Fp8Recipe::Delayed
                                    ? "once for the run, the routed experts' once per optimizer step "
                                      "(precision.fp8_weight_cache: the base is frozen, an expert's delayed scale may "
                                      "change until it has received rows)"
                                    : "once for the run (precision.fp8_weight_cache: the base is frozen)")
                             : "once per optimizer step (precision.fp8_weight_cache)",
               // NOTE [FP8 under data parallelism]
               config.parallelism.data_parallel_shard_degree * config.parallelism.data_parallel_replicate_degree == 1
                   ? std::string()
                   : p.fp8_fsdp_all_gather
                   ? fmt::format("; under FSDP the blocks' FP8 weights are all-gathered as E4M3 codes, 1 byte each "
                                 "(precision.fp8_fsdp_all_gather){}{}",
                                 // NOTE [FP8 all-gather pieces]: the stacks with the router, in bf16
                                 // (NOTE [FP8 all-gather] under expert parallelism: the slices in bf16)
                                 !m.moe() ? ""
                                 : config.parallelism.expert_parallel_degree > 1
                                     ? ", the routed experts' slices in bf16 over the ranks holding the same experts"
                                 : !fp8->routed_experts ? ", the routed experts' stacks in bf16 with the router and the norms"
                                                        : "",
                                 p.fp8 == "delayed" ? ", the step's amaxes max-reduced over the ranks"
                                 : expert_pieces || m.mla()
                                     ? fmt::format(", each weight's amax ({}) max-reduced over the ranks per gather",
                                                   expert_pieces
                                                       ? (m.mla() ? "each routed expert's, each kv_a row view's"
                                                                  : "each routed expert's")
                                                       : "each kv_a row view's")
                                     : std::string(", each weight's amax max-reduced over the ranks per gather"))
                   : config.lora.quantize_base == "nf4"
                   ? fmt::format("; each data-parallel rank casts its replica of the base{}",
                                 p.fp8 == "delayed" ? ", the step's amaxes max-reduced over the ranks" : "")
                   : fmt::format("; under FSDP each rank casts the bf16 weights its gathers bring{}{}",
                                 p.fp8 == "delayed" ? ", the step's amaxes max-reduced over the ranks" : "",
                                 p.fp8_weight_cache && t.device == "cuda" ? ", the cache holding every FP8 weight in full"
                                                                           : ""));
    if (!fp8->filter_fqns.empty())  // NOTE [FP8 filter]
      fmt::print("                 {}\n", describe_fp8_filter(m, *fp8));
  }
  MemoryPlan plan = memory_plan_of(config);
  fmt::print("memory           micro-batch {}, seq {}, activation_checkpoint.mode {}, optimizer.state_dtype {}{}{}{}{}:\n",
             t.local_batch_size, t.seq_len, activation_checkpoint_name(plan.checkpoint), config.optimizer.state_dtype,
             !plan.fsdp ? std::string()
             : plan.lora.enabled() && plan.lora.quantize_base == "nf4"
                 ? fmt::format("; per rank of {} data-parallel ranks (the NF4 base and the adapters replicated{})",
                               plan.shard_ranks * config.parallelism.data_parallel_replicate_degree,
                               plan.expert_parallel > 1
                                   ? fmt::format(", but for the base's routed experts: {} of the {} per rank",
                                                 m.num_experts / plan.expert_parallel, m.num_experts)
                                   : std::string())
                 : fmt::format("; per rank of FSDP ZeRO-{} over {} shard ranks{}", plan.zero_stage, plan.shard_ranks,
                               plan.expert_parallel > 1
                                   ? fmt::format(", expert parallelism {} ({} of the {} routed experts per rank)",
                                                 plan.expert_parallel, m.num_experts / plan.expert_parallel,
                                                 m.num_experts)
                                   : std::string()),
             plan.tensor_parallel > 1
                 ? fmt::format("; tensor parallelism {} (a rank's heads, feed-forward columns and vocabulary rows, "
                               "{} of the {} parameters, and its 1/{} of the tokens between the projections{})",
                               plan.tensor_parallel,
                               fmt::format("{:.2f} B", static_cast<double>(tensor_parallel_rank_parameters(m, plan.tensor_parallel)) / 1e9),
                               fmt::format("{:.2f} B", static_cast<double>(m.total_params()) / 1e9),
                               plan.tensor_parallel,
                               config.parallelism.enable_async_tensor_parallel  // NOTE [Async tensor parallelism]
                                   ? "; async: the blocks' all-gathers and reduce-scatters pass around a ring under "
                                     "their GEMMs' row chunks"
                                   : "")
                 : std::string(),
             plan.context_parallel > 1
                 ? fmt::format("; context parallelism {} (a rank's 2 of the {} chunks of every sequence, {})",
                               plan.context_parallel, 2 * plan.context_parallel,
                               plan.context_parallel_rotate == ContextParallelRotate::Ring
                                   ? "the keys and values passed around a ring for attention"
                                   : "the keys and values of all gathered for attention")
                 : std::string(),
             plan.pipeline_parallel > 1
                 ? fmt::format("; pipeline parallelism {} x {} stage{} per rank ({} micro-batches; the fullest rank: "
                               "its stages' parameters and the activations of the micro-batches it holds in flight)",
                               plan.pipeline_parallel, plan.pipeline_virtual_stages,
                               plan.pipeline_virtual_stages > 1 ? "s" : "", plan.micro_batches)
                 : std::string());
  const DType configured_state = plan.optimizer_state;
  for (bool cuda : {false, true}) {
    plan.cuda = cuda;
    plan.optimizer_state = cuda ? configured_state : DType::F32;  // the CPU reference keeps fp32 moments
    fmt::print("  {:14} {}\n", cuda ? "one GPU (bf16)" : "CPU (fp32)", describe(estimate_memory(m, plan), cuda));
  }
  if (hf_dir) print_implied_yaml(config, inv.positional);
  return 0;
}

int run_hf_info(const std::vector<std::string>& args) {
  Invocation inv = parse_invocation(args, "hf-info");
  if (inv.positional.empty()) FORGE_FAIL("forge hf-info: give a Hugging Face model directory");
  const std::string& dir = inv.positional;
  const ExperimentConfig config = hf_experiment(dir, inv.overrides);
  const ModelConfig& m = config.model;
  HfWeightFiles files(dir);
  std::map<std::string, int64_t> tensors_by_dtype;
  int64_t stored_elements = 0;
  for (const LocatedTensor& t : files.all()) {
    ++tensors_by_dtype[std::string(safetensors_dtype_name(t.entry->dtype))];
    stored_elements += t.entry->numel();
  }
  std::vector<std::string> dtypes;
  for (const auto& [dtype, count] : tensors_by_dtype) dtypes.push_back(fmt::format("{} {}", count, dtype));
  fmt::print("# model          {}\n", m.name);
  fmt::print("# architecture   {}\n", architecture_summary(m));
  fmt::print("# parameters     {} by config.json; {} stored in {} file(s): {} tensors\n", m.total_params(),
             stored_elements, files.files().size(), fmt::join(dtypes, ", "));
  print_implied_yaml(config, dir);
  return 0;
}

int run_keys() {
  fmt::print("{}", describe_keys());
  return 0;
}

}  // namespace forge
