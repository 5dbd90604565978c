// Cross-key validation and batch-size resolution; see config_validate.h.
#include "cli/config_validate.h"
#include "ckpt/flux_weights.h"
#include "model/flux_config.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <initializer_list>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ckpt/hf_export.h"
#include "cli/config_schema.h"
#include "core/checked_math.h"
#include "core/error.h"
#include "core/log.h"
#include "data/blended_dataset.h"
#include "distributed/launch_env.h"
#include "model/context_parallel.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model/nf4_base.h"
#include "model/pipeline.h"
#include "model/tensor_parallel.h"
#include "optim/config_rules.h"

namespace forge {
namespace {

std::string origin_of(const ConfigOrigins& origins, const std::string& key) {
  auto it = origins.find(key);
  return it == origins.end() ? "default value" : it->second;
}

// NOTE [Origins in config errors]
// The model's and the optimizer's rules live beside what they constrain
// (model/config_rules.cpp, optim/config_rules.cpp) and name keys through a KeyDescriber
// (NOTE [Config rules name their keys through the caller] in core/config_check.h). This
// one adds the origins, so a rule reads "model.num_heads = 30 (exp.yaml:5) must be
// divisible by model.num_kv_heads = 4 (command line)". The relations below, which no
// single section owns, say the same through it.
KeyDescriber key_describer(const ConfigOrigins& origins) {
  return KeyDescriber([&origins](std::string_view key) { return origin_of(origins, std::string(key)); });
}

// "training.seq_len = 512 (exp.yaml:5)": a key, its value and where the value came from.
std::string show(const ExperimentConfig& config, const KeyDescriber& keys, const std::string& key) {
  return keys.describe(key, format_config_value(*find_config_key(key), config));
}

// A value of training.gemm_tuning_cache that reads as a switch, not a directory: "false"
// would otherwise become a directory named false. Only "off" (exactly) is the switch.
bool is_switch_word(const std::string& value) {
  std::string lower = value;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  for (std::string_view word : {"true", "false", "yes", "no", "on", "off", "none", "null", "disable", "disabled"})
    if (lower == word) return value != "off";
  return false;
}

// Relations between the training section and the model or optimizer section.
void check_training(const ExperimentConfig& config, const KeyDescriber& keys) {
  if (config.training.seq_len > config.model.max_seq_len && !config.training.allow_longer_seq_len) {
    FORGE_FAIL("{} exceeds {}; to train on longer sequences than the model was built for (long-context "
               "fine-tuning), set training.allow_longer_seq_len true",
               show(config, keys, "training.seq_len"), show(config, keys, "model.max_seq_len"));
  }
  if (config.training.seq_len > config.model.max_seq_len) {
    log_warn("{} exceeds {} ({}): positions past the model's are extrapolated by RoPE until training adapts them",
             show(config, keys, "training.seq_len"), show(config, keys, "model.max_seq_len"),
             show(config, keys, "training.allow_longer_seq_len"));
  }
  if (config.optimizer.state_dtype == "bf16" && config.training.device != "cuda") {
    FORGE_FAIL("{} needs training.device cuda: the CPU reference keeps fp32 moments",
               show(config, keys, "optimizer.state_dtype"));
  }
  if (config.training.loss_spike_factor > 0 && config.training.loss_spike_factor <= 1) {
    FORGE_FAIL("{} must be 0 (off) or above 1: a factor of at most 1 makes ordinary steps spikes",
               show(config, keys, "training.loss_spike_factor"));
  }
  if (is_switch_word(config.training.gemm_tuning_cache)) {
    FORGE_FAIL("{} expects a directory, empty for forge's cache directory, or off to keep no cache",
               show(config, keys, "training.gemm_tuning_cache"));
  }
}

// Megatron's --split: up to three non-negative weights separated by commas, not all zero.
bool is_valid_split(std::string_view split) {
  int parts = 0;
  double total = 0;
  while (true) {
    const auto comma = split.find(',');
    const std::string_view part = split.substr(0, comma);
    double weight = 0;
    auto [end, error] = std::from_chars(part.data(), part.data() + part.size(), weight);
    if (part.empty() || error != std::errc() || end != part.data() + part.size() || weight < 0) return false;
    total += weight;
    ++parts;
    if (comma == std::string_view::npos) break;
    split.remove_prefix(comma + 1);
  }
  return parts <= 3 && total > 0;
}

void check_data(const ExperimentConfig& config, const ConfigOrigins& origins, const KeyDescriber& keys) {
  auto show_key = [&](const std::string& key) { return show(config, keys, key); };
  if (config.data.source == "sft" && config.data.path.empty()) {
    FORGE_FAIL("{} needs data.path (the prefix of the .bin/.idx and .mask.bin/.mask.idx files)",
               show_key("data.source"));
  }
  if (config.data.source == "govreport_npy" && config.data.path.empty()) {
    FORGE_FAIL("{} needs data.path (the folder of train.npy and validation.npy)", show_key("data.source"));
  }
  if ((config.data.source == "sft" || config.data.source == "govreport_npy") && !config.data.blend.empty()) {
    FORGE_FAIL("{} reads one dataset: data.blend is for indexed data", show_key("data.source"));
  }
  if (config.data.source == "indexed" && config.data.path.empty() && config.data.blend.empty()) {
    FORGE_FAIL("{} needs data.path (the prefix of the .bin/.idx files) or data.blend (\"W1 PREFIX1 W2 PREFIX2 "
               "...\")",
               show_key("data.source"));
  }
  if (!config.data.path.empty() && !config.data.blend.empty()) {
    FORGE_FAIL("{} and {} are both set: give one of them", show_key("data.path"), show_key("data.blend"));
  }
  if (!config.data.validation_path.empty() && config.data.source != "indexed") {
    FORGE_FAIL("{} is for data.source indexed, but {}", show_key("data.validation_path"), show_key("data.source"));
  }
  if (config.data.source == "indexed" && !config.data.blend.empty()) {
    try {
      parse_blend(config.data.blend);
    } catch (const Error& e) {
      FORGE_FAIL("{}: {}", origin_of(origins, "data.blend"), e.what());
    }
  }
  if (!is_valid_split(config.data.split)) {
    FORGE_FAIL("{}: data.split expects up to three non-negative weights separated by commas, such as 969,30,1, "
               "got '{}'",
               origin_of(origins, "data.split"), config.data.split);
  }
}

void check_checkpoint(const ExperimentConfig& config, const KeyDescriber& keys) {
  auto show_key = [&](const std::string& key) { return show(config, keys, key); };
  if (config.checkpoint.initial_load_in_hf && config.checkpoint.initial_load_path.empty()) {
    FORGE_FAIL("{} needs checkpoint.initial_load_path: the Hugging Face model directory to start from",
               show_key("checkpoint.initial_load_in_hf"));
  }
  if (config.checkpoint.load_step >= 0 && !config.checkpoint.enable) {
    FORGE_FAIL("{} needs checkpoint.enable: true (resuming is part of checkpointing)",
               show_key("checkpoint.load_step"));
  }
  export_max_shard_bytes(config.checkpoint.export_max_shard_size, 1, show_key("checkpoint.export_max_shard_size"));
}

void check_lora(const ExperimentConfig& config, const KeyDescriber& keys) {
  config.lora.validate(keys);
  // QLoRA (NOTE [QLoRA base] in model/nf4_base.h): the NF4 base is frozen, so only
  // adapters can train on it. (That it is imported from Hugging Face weights is the
  // trainer's check: forge info sizes a QLoRA preset without a model folder.)
  if (config.lora.quantize_base == "nf4" && !config.lora.enabled())
    FORGE_FAIL("{} freezes the base in NF4 and needs LoRA adapters to train: set lora.rank > 0 (it is {}), or "
               "lora.quantize_base none for full training",
               show(config, keys, "lora.quantize_base"), config.lora.rank);
  check_lora_for_model(config.model, config.lora, keys);  // NOTE [LoRA on MoE and MLA models]
}

// NOTE [FP8 filter] in model/fp8_projections.h: each string non-empty, given once, and
// contained in the name of at least one block projection (or routed-expert stack) the run
// would otherwise train in FP8; the error names the model's first block's.
void check_fp8_filter(const ExperimentConfig& config, const KeyDescriber& keys) {
  const std::vector<std::string> filters = fp8_filter_fqns_of(config.precision.fp8_filter_fqns);
  if (filters.empty()) return;
  const std::string key = show(config, keys, "precision.fp8_filter_fqns");
  Fp8Settings settings;
  settings.routed_experts = config.precision.fp8_routed_experts;
  const std::vector<ParamSpec> candidates = fp8_filter_candidates(config.model, settings);
  std::vector<std::string> first_block;
  for (const ParamSpec& spec : candidates)
    if (spec.layer == 0) first_block.push_back(spec.name);
  for (size_t i = 0; i < filters.size(); ++i) {
    if (filters[i].empty())
      FORGE_FAIL("{} has an empty string: expected comma-separated parts of block projection names, such as "
                 "'layers.0.' or 'mlp.down'",
                 key);
    if (std::find(filters.begin(), filters.begin() + static_cast<std::ptrdiff_t>(i), filters[i]) !=
        filters.begin() + static_cast<std::ptrdiff_t>(i))
      FORGE_FAIL("{} lists '{}' twice", key, filters[i]);
    if (std::none_of(candidates.begin(), candidates.end(),
                     [&](const ParamSpec& spec) { return spec.name.find(filters[i]) != std::string::npos; }))
      FORGE_FAIL("{}: '{}' is not part of the name of any projection this run trains in FP8 (this model's {} blocks "
                 "name them like {}; the output head has its own key, precision.fp8_output_head)",
                 key, filters[i], config.model.num_layers, fmt::join(first_block, ", "));
  }
}

// precision.fp8 (NOTE [FP8 projections] in model/fp8_projections.h): full training on one
// device or under FSDP (NOTE [FP8 under data parallelism] in train/trainer_fp8.cpp), context
// or pipeline parallelism (NOTE [FP8 under context and pipeline parallelism]), and LoRA over
// a bf16 base, on one device, over FSDP's frozen base or a pipeline rank's stages of it
// (NOTE [FP8 frozen base]; NOTE [LoRA under pipeline parallelism] in model/lora.h: the base's
// forward and input-gradient GEMMs in FP8, the adapters in bf16; on a MoE or MLA model the
// frozen routed experts and MLA's projections too, NOTE [FP8 frozen routed experts] in
// ops/moe_fp8.h, under expert parallelism as well), and QLoRA wherever it runs (NOTE [FP8
// over an NF4 base] in model/nf4_base.cpp: each NF4 weight cast to E4M3 per GEMM, on CUDA
// straight from its codes, NOTE [FP8 straight from NF4]; on MoE and MLA models the NF4 expert
// stacks and latent attention's projections too, NOTE [FP8 over NF4 expert stacks]). The FP8
// all-gather runs in full training and over LoRA's frozen bf16 base (NOTE [FP8 all-gather of a
// frozen base]), over a pipeline rank's stages too; QLoRA's replicated base has nothing to gather.
void check_fp8(const ExperimentConfig& config, const KeyDescriber& keys) {
  if (config.precision.fp8 == "none") {
    if (config.precision.fp8_fsdp_all_gather)
      FORGE_FAIL("{} gathers the FP8 projections' weights as FP8 codes, and precision.fp8 is none: set it to false, "
                 "or precision.fp8 tensorwise or delayed",
                 show(config, keys, "precision.fp8_fsdp_all_gather"));
    // The keys that keep GEMMs out of FP8 mean nothing when none runs in it.
    const struct {
      const char* key;
      const char* keeps;
      bool set;
    } exclusions[] = {
        {"precision.fp8_routed_experts", "a Mixture-of-Experts model's routed experts",
         !config.precision.fp8_routed_experts},
        {"precision.fp8_filter_fqns", "projections", !fp8_filter_fqns_of(config.precision.fp8_filter_fqns).empty()},
        {"precision.fp8_weight_gradient", "the weight gradients", !config.precision.fp8_weight_gradient},
    };
    for (const auto& e : exclusions)
      if (e.set)
        FORGE_FAIL("{} keeps {} out of FP8, and precision.fp8 is none (every GEMM runs in the compute dtype): remove "
                   "it, or set precision.fp8 tensorwise or delayed",
                   show(config, keys, e.key), e.keeps);
    return;
  }
  check_fp8_filter(config, keys);
  // NOTE [FP8 weight gradient switch] in ops/fp8_linear.h: full training's choice.
  if (!config.precision.fp8_weight_gradient && config.lora.enabled())
    FORGE_FAIL("{} keeps the weight gradients out of FP8, and a LoRA run's FP8 base is frozen (it has none; its "
               "adapters already train in the compute dtype): remove it",
               show(config, keys, "precision.fp8_weight_gradient"));
  // NOTE [FP8 routed experts switch] in model/fp8_projections.h: a MoE model's choice.
  if (!config.precision.fp8_routed_experts && !config.model.moe())
    FORGE_FAIL("{} keeps a Mixture-of-Experts model's routed experts out of FP8, and this model has none "
               "(model.num_experts 0): remove it (every projection of a dense model runs in FP8)",
               show(config, keys, "precision.fp8_routed_experts"));
  const ParallelismConfig& p = config.parallelism;
  if (config.precision.fp8_fsdp_all_gather) {
    const std::string key = show(config, keys, "precision.fp8_fsdp_all_gather");
    // FSDP shards over the context-parallel ranks too (NOTE [Context-parallel steps]).
    if (p.data_parallel_shard_degree * p.context_parallel_degree == 1)
      FORGE_FAIL("{} gathers FSDP's shards, and this run has none (parallelism.data_parallel_shard_degree 1): set "
                 "it to false, or shard over several ranks",
                 key);
    // NOTE [FP8 all-gather of a frozen base] in distributed/fsdp.h: LoRA's bf16 base too.
    if (config.lora.quantize_base != "none")
      FORGE_FAIL("{} gathers FSDP's shards, and QLoRA's NF4 base is not sharded (each data-parallel rank holds it "
                 "whole): set it to false",
                 key);
    // NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h: a MoE block's routed
    // experts travel as one piece per expert (in bf16 with the router under
    // precision.fp8_routed_experts false), MLA's kv_a as its two row views, the router in
    // bf16; under expert parallelism the experts' slices in bf16 over the ranks holding the
    // same experts (NOTE [FP8 all-gather] in distributed/fsdp.h).
  }
  if (config.training.device != "cuda") return;
  // Hopper's FP8 GEMMs (NOTE [FP8 GEMM layout] in kernels/cuda/fp8_matmul.h) contract over a
  // multiple of 16 and write rows of 16-byte multiples: every dimension of a projection and,
  // in full training, the micro-batch's tokens (the weight gradient's contraction) are
  // contracted in one of the three GEMMs. A frozen LoRA base has no weight gradient: its
  // tokens are never contracted (MLPerf's GovReport micro-batch of 8,191 tokens runs in FP8).
  // A projection's output width is contracted by its input gradient, its input width by the
  // forward and the weight gradient. A routed expert's rows are padded to 16 (NOTE [FP8
  // padded token contraction] in ops/fp8_linear.h).
  const ModelConfig& m = config.model;
  std::vector<std::pair<std::string, int64_t>> dims = {{"model.hidden_size", m.hidden_size}};
  if (m.mla()) {  // NOTE [FP8 latent attention] in model/latent_attention.h
    const int64_t q_width = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim);
    dims.emplace_back("the query width (num_heads × (qk_nope_head_dim + qk_rope_head_dim))", q_width);
    if (m.q_lora_rank > 0) dims.emplace_back("model.q_lora_rank", m.q_lora_rank);
    dims.emplace_back("model.kv_lora_rank", m.kv_lora_rank);
    dims.emplace_back("model.qk_rope_head_dim (kv_a's rotary rows)", m.qk_rope_head_dim);
    dims.emplace_back("kv_b's width (num_heads × (qk_nope_head_dim + v_head_dim))",
                      m.num_heads * (m.qk_nope_head_dim + m.v_head_dim));
    dims.emplace_back("the attention output's width (num_heads × v_head_dim)", m.num_heads * m.v_head_dim);
  } else {
    dims.emplace_back("the attention's query width (num_heads × head_dim)", m.q_size());
    dims.emplace_back("the qkv projection's width ((num_heads + 2 × num_kv_heads) × head_dim)",
                      m.q_size() + 2 * m.kv_size());
  }
  if (!m.moe() || m.first_dense_layers > 0) dims.emplace_back("model.ffn_hidden_size", m.ffn_hidden_size);
  // Without the routed experts in FP8 (NOTE [FP8 routed experts switch]) the shared experts' alone.
  if (m.moe() && config.precision.fp8_routed_experts)
    dims.emplace_back("model.moe_ffn_hidden_size (the routed and shared experts' width)", m.resolved_moe_ffn());
  else if (m.moe() && m.num_shared_experts > 0)
    dims.emplace_back("the shared experts' width (num_shared_experts × moe_ffn_hidden_size)",
                      m.num_shared_experts * m.resolved_moe_ffn());
  // Under context parallelism a rank's weight gradient contracts over its chunks' tokens;
  // in the compute dtype (NOTE [FP8 weight gradient switch]) no FP8 GEMM does.
  const int64_t cp = p.context_parallel_degree;
  if (!config.lora.enabled() && config.precision.fp8_weight_gradient)
    dims.emplace_back(cp > 1 ? "the tokens of a micro-batch on a context-parallel rank (training.local_batch_size × "
                               "training.seq_len / parallelism.context_parallel_degree)"
                             : "the tokens of a micro-batch (training.local_batch_size × training.seq_len)",
                      config.training.local_batch_size * config.training.seq_len / cp);
  if (config.precision.fp8_output_head) dims.emplace_back("model.vocab_size (precision.fp8_output_head)", m.vocab_size);
  for (const auto& [what, value] : dims)
    if (value % 16 != 0)
      FORGE_FAIL("{} on CUDA runs Hopper's FP8 GEMMs, which need every contracted dimension to be a multiple of 16: "
                 "{} is {}",
                 show(config, keys, "precision.fp8"), what, value);
}

// model.num_experts > 0 (NOTE [MoE feed-forward] in model/moe_feed_forward.h): what a MoE
// run cannot combine with yet is refused here, naming what to change.
void check_moe(const ExperimentConfig& config, const KeyDescriber& keys) {
  if (!config.model.moe()) return;
  const std::string moe = show(config, keys, "model.num_experts");
  // On CUDA the router's GEMMs have the experts as a leading dimension, which cuBLASLt
  // wants 16-byte aligned in bf16; the routing kernels hold a token's scores in one warp.
  if (config.training.device == "cuda" && (config.model.num_experts % 8 != 0 || config.model.num_experts > 1024))
    FORGE_FAIL("{} must be a multiple of 8 and at most 1024 on CUDA (training.device cuda)", moe);
  // Data parallelism (FSDP) shards the experts with every other weight; each rank routes its
  // own tokens through all of them, or with parallelism.expert_parallel_degree through the
  // ranks that hold them. The routing biases' update moves each rank's chunk of them (NOTE
  // [Routing bias update] in train/trainer.cpp).
  // FP8 (NOTE [FP8 routed experts] in ops/moe_fp8.h): the routed experts' GEMMs per expert,
  // the router in bf16; under expert parallelism on each rank's received rows (NOTE [FP8
  // routed experts under expert parallelism]). Under LoRA the frozen experts run their
  // forward and input gradient in FP8 and their adapters in the compute dtype (NOTE [FP8
  // frozen routed experts]).
  // LoRA (NOTE [LoRA on MoE and MLA models] in model/lora.h): adapters on the 2-D
  // projections and, when named, the routed experts' stacks; the routing biases and the rest
  // of the base frozen.
  // QLoRA quantizes the routed experts too, one NF4 tensor per expert matrix (NOTE [NF4
  // expert stacks] in model/nf4_base.h).
  if (config.lora.enabled() && config.model.router_bias_update_rate != 0.0)
    FORGE_FAIL("{} moves the routing biases, which belong to LoRA's frozen base (held in the compute dtype, not in "
               "its checkpoints, and not trained by PEFT either): set it to 0 under LoRA (lora.rank {})",
               show(config, keys, "model.router_bias_update_rate"), config.lora.rank);
  // LoRA under expert parallelism: NOTE [LoRA under expert parallelism] in model/lora.h; QLoRA's
  // NF4 base holds each rank's experts (NOTE [NF4 expert stacks under expert parallelism]).
}

// parallelism.expert_parallel_degree P > 1 (NOTE [Expert parallelism] in
// model/expert_dispatch.h): groups of P consecutive shard ranks split the routed experts,
// so P divides the experts and the shard ranks; the expert parts are sharded over the
// shard ranks that hold the same experts; under hybrid sharding inside each replica, the
// replicas summing the expert chunks' gradients as the others' (NOTE [Expert parallelism
// under hybrid sharding] in distributed/expert_dispatch_group.cpp).
void check_expert_parallel(const ExperimentConfig& config, const KeyDescriber& keys) {
  const ParallelismConfig& p = config.parallelism;
  if (p.expert_parallel_degree == 1) return;
  const std::string ep = show(config, keys, "parallelism.expert_parallel_degree");
  if (!config.model.moe())
    FORGE_FAIL("{} needs a Mixture-of-Experts model (model.num_experts > 0); {} is dense", ep, config.model.name);
  if (config.model.num_experts % p.expert_parallel_degree != 0)
    FORGE_FAIL("{} must divide {} (each rank holds an equal share of the experts)", ep,
               show(config, keys, "model.num_experts"));
  if (p.data_parallel_shard_degree % p.expert_parallel_degree != 0)
    FORGE_FAIL("{} must divide {} (expert-parallel groups are formed from the shard ranks)", ep,
               show(config, keys, "parallelism.data_parallel_shard_degree"));
}

// parallelism.enable_async_tensor_parallel (NOTE [Async tensor parallelism] in
// model/sequence_parallel.h): tensor parallelism, projections in the compute dtype (an FP8
// projection quantizes its whole gathered input at once) and no LoRA adapters (their
// dropout and gradients are one call over every row).
void check_async_tensor_parallel(const ExperimentConfig& config, const KeyDescriber& keys) {
  if (!config.parallelism.enable_async_tensor_parallel) return;
  const std::string async = show(config, keys, "parallelism.enable_async_tensor_parallel");
  if (config.parallelism.tensor_parallel_degree == 1)
    FORGE_FAIL("{} overlaps tensor parallelism's collectives with its GEMMs and needs "
               "parallelism.tensor_parallel_degree > 1 (it is 1): set it to false, or set the degree",
               async);
  if (config.precision.fp8 != "none")
    FORGE_FAIL("{} with {}: an FP8 projection quantizes its whole gathered input at once, which the ring's row "
               "chunks do not give; set parallelism.enable_async_tensor_parallel to false, or precision.fp8 none",
               async, show(config, keys, "precision.fp8"));
  if (config.lora.enabled())
    FORGE_FAIL("{} with {}: LoRA adapters draw their dropout and gradients over every row in one call, which the "
               "ring's row chunks do not give; set parallelism.enable_async_tensor_parallel to false",
               async, show(config, keys, "lora.rank"));
}

// parallelism.tensor_parallel_degree T > 1 (NOTE [Tensor parallelism] in
// model/tensor_parallel.h): a dense Llama-family model whose heads, feed-forward width and
// vocabulary T divides, a micro-batch whose tokens it divides (the residual stream's rows);
// full training or LoRA in the compute dtype or in FP8, with FSDP's FP8 all-gather too (NOTE
// [FP8 under tensor parallelism] in model/fp8_projections.h), or QLoRA whose shards are whole
// NF4 blocks (NOTE [NF4 base under tensor parallelism] in model/nf4_base.h). Checkpoints,
// initial weights (a forge checkpoint or a Hugging Face model) and the Hugging Face export
// hold whole parameters, each rank reading or writing its shards' places in them (NOTE
// [Tensor-parallel checkpoints] in ckpt/checkpoint_layout.h): nothing to refuse there.
void check_tensor_parallel_degree(const ExperimentConfig& config, const KeyDescriber& keys) {
  const int64_t t = config.parallelism.tensor_parallel_degree;
  check_async_tensor_parallel(config, keys);
  if (t == 1) return;
  const std::string tp = show(config, keys, "parallelism.tensor_parallel_degree");
  try {
    check_tensor_parallel(config.model, t);
  } catch (const Error& e) {
    FORGE_FAIL("{}: {}", tp, e.what());
  }
  const TrainingConfig& training = config.training;
  const int64_t cp = config.parallelism.context_parallel_degree;  // the rank's tokens are 1/cp of the micro-batch's
  if ((training.local_batch_size * training.seq_len / cp) % t != 0)
    FORGE_FAIL("{} must divide the micro-batch's tokens{}, {} × {}{} = {} (each rank holds its share of the "
               "residual stream's rows)",
               tp, cp > 1 ? " on a context-parallel rank" : "", show(config, keys, "training.local_batch_size"),
               show(config, keys, "training.seq_len"), cp > 1 ? fmt::format(" / {}", cp) : "",
               training.local_batch_size * training.seq_len / cp);
  const ModelConfig& m = config.model;
  // cuBLASLt and cuDNN want every row of the rank's shards 16-byte aligned in bf16.
  if (training.device == "cuda")
    for (auto [key, value] : {std::pair{"model.ffn_hidden_size", m.ffn_hidden_size},
                              {"model.vocab_size", m.vocab_size}})
      if ((value / t) % 8 != 0)
        FORGE_FAIL("{} with {}: each rank's share, {} / {} = {}, must be a multiple of 8 on CUDA", tp,
                   show(config, keys, key), value, t, value / t);
  // LoRA: NOTE [LoRA under context and tensor parallelism] in model/lora.h. QLoRA: each rank
  // quantizes its shards, whose NF4 blocks must be blocks of the whole tensors (NOTE [NF4
  // base under tensor parallelism] in model/nf4_base.h).
  if (config.lora.quantize_base == "nf4") {
    try {
      check_nf4_tensor_parallel(m, t);
    } catch (const Error& e) {
      FORGE_FAIL("{} with {}: {}", tp, show(config, keys, "lora.quantize_base"), e.what());
    }
  }
}

// parallelism.context_parallel_degree C > 1 (NOTE [Context parallelism] in
// model/context_parallel.h): a dense Llama-family model, sequences that split into 2C
// chunks, with or without a sliding window, with or without packed examples (data.source sft
// and govreport_npy: NOTE [Chunk attention with packed examples] in ops/attention_chunk.h);
// both rotate methods, but not packed examples with a window under the ring; full training or
// LoRA and QLoRA (NOTE [LoRA under context and tensor parallelism] in model/lora.h), in the compute
// dtype or in FP8 (NOTE [FP8 under context and pipeline parallelism] in train/trainer_fp8.cpp).
void check_context_parallel_degree(const ExperimentConfig& config, const KeyDescriber& keys) {
  const int64_t c = config.parallelism.context_parallel_degree;
  if (c == 1) return;
  const std::string cp = show(config, keys, "parallelism.context_parallel_degree");
  try {
    check_context_parallel(config.model, c, config.training.seq_len);
  } catch (const Error& e) {
    FORGE_FAIL("{} with {}: {}", cp, show(config, keys, "training.seq_len"), e.what());
  }
  // Ring attention (NOTE [Ring attention] in model/context_parallel_ring.h): a sliding window
  // (NOTE [Ring attention with a sliding window]) but, on CUDA, not one that leaves a band of
  // a single query, which cuDNN does not take; packed examples (NOTE [Ring attention with packed
  // examples]) but not with a window.
  if (config.parallelism.context_parallel_rotate_method != "p2p") return;
  const std::string ring = show(config, keys, "parallelism.context_parallel_rotate_method");
  const int64_t window = config.model.sliding_window, chunk = config.training.seq_len / (2 * c);
  if (config.training.device == "cuda" && window >= 2 && (window - 2) % chunk == 0 && (window - 2) / chunk <= 2 * c - 2)
    FORGE_FAIL("{} with {} on CUDA ({}, {}: chunks of {} positions): {} - 2 is a multiple of the chunk length, "
               "which leaves a query of a later chunk seeing a single key of an earlier one, and cuDNN's fused "
               "attention takes no single query; choose another model.sliding_window or training.seq_len, or use "
               "parallelism.context_parallel_rotate_method allgather",
               ring, show(config, keys, "model.sliding_window"), show(config, keys, "training.seq_len"), cp, chunk,
               window);
  if ((config.data.source == "sft" || config.data.source == "govreport_npy") && window > 0)
    FORGE_FAIL("{} with {} and {}: ring attention takes packed examples or a sliding window, not both (a chunk "
               "pair would be a band of one example's rows, NOTE [Ring attention with packed examples]); use "
               "parallelism.context_parallel_rotate_method allgather",
               ring, show(config, keys, "data.source"), show(config, keys, "model.sliding_window"));
}

// parallelism.pipeline_parallel_degree P > 1 (NOTE [Pipeline parallelism] in
// model/pipeline.h): the blocks cut into P x V equal stages, the schedule's micro-batches
// the gradient accumulation's. Full training in the compute dtype or in FP8 (NOTE [FP8
// under context and pipeline parallelism] in train/trainer_fp8.cpp), LoRA and QLoRA (NOTE
// [LoRA under pipeline parallelism] in model/lora.h); Multi-head Latent Attention and
// Mixture-of-Experts blocks, with every balancing loss (NOTE [Pipeline stages] in
// model/pipeline_stage.h), and with expert parallelism over a stage's shard ranks
// (NOTE [Expert parallelism under pipeline parallelism] in model/pipeline.h); the rest is
// refused by name.
void check_pipeline_parallel_degree(const ExperimentConfig& config, const KeyDescriber& keys) {
  const ParallelismConfig& p = config.parallelism;
  const int64_t degree = p.pipeline_parallel_degree;
  if (degree == 1) return;
  const std::string pp = show(config, keys, "parallelism.pipeline_parallel_degree");
  const ModelConfig& m = config.model;
  const bool interleaved = p.pipeline_parallel_schedule == "Interleaved1F1B";
  const int64_t per_stage = p.pipeline_parallel_layers_per_stage > 0
                                ? p.pipeline_parallel_layers_per_stage
                                : m.num_layers / (degree * (interleaved ? 2 : 1));
  const std::string layers = show(config, keys, "parallelism.pipeline_parallel_layers_per_stage");
  if (per_stage < 1 || m.num_layers % (per_stage * degree) != 0)
    FORGE_FAIL("{} with {}{}: the model's {} blocks (model.num_layers) must cut into stages of {} blocks, a multiple "
               "of the degree of them",
               pp, layers, p.pipeline_parallel_layers_per_stage == 0 ? " (0: chosen from the schedule)" : "",
               m.num_layers, per_stage);
  const int64_t virtual_stages = m.num_layers / (per_stage * degree);
  const std::string schedule = show(config, keys, "parallelism.pipeline_parallel_schedule");
  if (!interleaved && virtual_stages != 1)
    FORGE_FAIL("{} with {}: 1F1B gives each rank one stage of model.num_layers / degree = {} blocks; {} asks for "
               "{} stages per rank, which is Interleaved1F1B",
               schedule, pp, m.num_layers / degree, layers, virtual_stages);
  if (interleaved && virtual_stages < 2)
    FORGE_FAIL("{} needs at least two stages per rank: {} gives model.num_layers / ({} x {}) = {}", schedule, layers,
               degree, per_stage, virtual_stages);
  const std::string accum = show(config, keys, "training.gradient_accumulation_steps");
  if (interleaved && config.training.gradient_accumulation_steps % degree != 0)
    FORGE_FAIL("{} takes the micro-batches in groups of {}: {} (the step's micro-batches) must be a multiple of it",
               schedule, pp, accum);
  try {
    check_pipeline_parallel(m, degree, virtual_stages);
  } catch (const Error& e) {
    FORGE_FAIL("{}: {}", pp, e.what());
  }
  // ZeRO-2 and -3 over a pipeline rank's stages (NOTE [ZeRO-2 and -3 under pipeline
  // parallelism] in distributed/fsdp.h), under either schedule: full training (MoE and MLA
  // blocks too, with expert parallelism: the stages' expert parts gathered and reduced over
  // their groups per use), LoRA's and QLoRA's frozen base (NOTE [Frozen FSDP base]: gathered
  // per use under ZeRO-3, its expert parts over their groups with expert parallelism), with
  // hybrid sharding and context parallelism (FSDP shards over the context-parallel ranks too:
  // NOTE [Context-parallel steps]) and tensor-parallel stages, and FP8 (tensorwise and
  // delayed, full training and LoRA's FP8 base: NOTE [FP8 under ZeRO-2 and -3 pipeline
  // ranks] in train/trainer_fp8.cpp). Nothing there is refused.
  // Expert parallelism: groups of a stage's shard ranks, which run the same schedule (NOTE
  // [Expert parallelism under pipeline parallelism] in model/pipeline.h); check_expert_parallel
  // asks the shard degree to take it. LoRA on a MoE model under both: NOTE [LoRA under pipeline
  // and expert parallelism] in model/lora.h (the pipeline's sum and the stage's sum compose);
  // QLoRA too, its NF4 base holding each rank's experts of its stages, the merged export
  // written by each of the stage's first expert-parallel group's ranks, its own experts'
  // (NOTE [QLoRA under pipeline and expert parallelism]).
  // The routing biases' update (NOTE [Routing bias update]) takes every stage's loads: NOTE [Pipeline stages].
  // LoRA and QLoRA: NOTE [LoRA under pipeline parallelism] in model/lora.h, with data, context and tensor
  // parallelism as without pipelining (their own rules, above and in check_tensor_parallel, still hold:
  // QLoRA's shards whole NF4 blocks), and LoRA's FP8 frozen base stage by stage.
}

// model.kv_lora_rank > 0 (NOTE [Multi-head Latent Attention] in model/latent_attention.h):
// the CUDA widths; its projections take adapters, FP8 and both together as any other.
void check_mla(const ExperimentConfig& config, const KeyDescriber& keys) {
  if (!config.model.mla()) return;
  // On CUDA the packing kernel moves 16-byte vectors of 8 bf16 (mla_pack_qkv, a rotary pair
  // group of 16), and cuBLASLt and cuDNN want every row 16-byte aligned.
  const ModelConfig& m = config.model;
  if (config.training.device == "cuda")
    for (auto [key, value, multiple] : {std::tuple{"model.qk_rope_head_dim", m.qk_rope_head_dim, int64_t{16}},
                                        {"model.qk_nope_head_dim", m.qk_nope_head_dim, int64_t{8}},
                                        {"model.v_head_dim", m.v_head_dim, int64_t{8}},
                                        {"model.kv_lora_rank", m.kv_lora_rank, int64_t{8}},
                                        {"model.q_lora_rank", m.q_lora_rank, int64_t{8}}})
      if (value % multiple != 0)
        FORGE_FAIL("{} must be a multiple of {} on CUDA (training.device cuda) with Multi-head Latent Attention",
                   show(config, keys, key), multiple);
  // FP8: NOTE [FP8 latent attention] in model/latent_attention.h; check_fp8 checks the widths.
  // Under LoRA the frozen projections' GEMMs in FP8 (NOTE [FP8 frozen base]).
  // LoRA: NOTE [LoRA on MoE and MLA models] in model/lora.h. QLoRA quantizes the query and
  // kv_a projections in the published row order (NOTE [NF4 stored row order] in ops/nf4.h).
}

// parallelism.data_parallel_shard_degree -1 (torchtitan's dp_shard -1): the ranks the
// launcher started, over the replicate degree.
void resolve_shard_degree(ExperimentConfig& config, const KeyDescriber& keys) {
  ParallelismConfig& p = config.parallelism;
  if (p.data_parallel_shard_degree == 0)
    FORGE_FAIL("{} must be >= 1, or -1 for every rank the launcher started",
               show(config, keys, "parallelism.data_parallel_shard_degree"));
  if (p.data_parallel_shard_degree != -1) return;
  const int world = read_launch_env().world_size;
  const int64_t others = p.data_parallel_replicate_degree * p.tensor_parallel_degree * p.context_parallel_degree *
                         p.pipeline_parallel_degree;
  if (world % others != 0)
    FORGE_FAIL("{}: {} ranks were started, not a multiple of parallelism.data_parallel_replicate_degree {} × "
               "tensor_parallel_degree {} × context_parallel_degree {} × pipeline_parallel_degree {}",
               show(config, keys, "parallelism.data_parallel_shard_degree"), world, p.data_parallel_replicate_degree,
               p.tensor_parallel_degree, p.context_parallel_degree, p.pipeline_parallel_degree);
  p.data_parallel_shard_degree = world / others;
}

// parallelism.zero_stage's default is 3, except under pipeline parallelism, which takes 1
// unless asked (Megatron-LM's distributed optimizer under pipelining: the gradients reduced
// once after the schedule, the weights kept gathered); 2 and 3 are asked for by name (NOTE
// [ZeRO-2 and -3 under pipeline parallelism] in distributed/fsdp.h).
void resolve_zero_stage(ExperimentConfig& config, const ConfigOrigins& origins) {
  if (config.parallelism.pipeline_parallel_degree > 1 && !origins.contains("parallelism.zero_stage"))
    config.parallelism.zero_stage = 1;
}

void resolve_batch(ExperimentConfig& config, const KeyDescriber& keys) {
  TrainingConfig& training = config.training;
  auto show_key = [&](const std::string& key) { return show(config, keys, key); };
  // Every product of these keys is checked (NOTE [Model sizes are checked before use]).
  auto product = [&](int64_t a, int64_t b, std::initializer_list<const char*> names) {
    if (auto p = checked_mul(a, b)) return *p;
    std::string described;
    for (const char* name : names) described += (described.empty() ? "" : " × ") + show_key(name);
    FORGE_FAIL("{} overflows 64-bit integers", described);
  };
  const int64_t dp = product(config.parallelism.data_parallel_shard_degree,
                             config.parallelism.data_parallel_replicate_degree,
                             {"parallelism.data_parallel_shard_degree", "parallelism.data_parallel_replicate_degree"});
  const int64_t samples_per_micro_step =
      product(training.local_batch_size, dp,
              {"training.local_batch_size", "parallelism.data_parallel_shard_degree",
               "parallelism.data_parallel_replicate_degree"});
  const auto all_batch_keys = {"training.local_batch_size", "training.gradient_accumulation_steps",
                               "parallelism.data_parallel_shard_degree", "parallelism.data_parallel_replicate_degree"};
  if (training.global_batch_size > 0 && training.gradient_accumulation_steps > 0) {
    const int64_t implied = product(samples_per_micro_step, training.gradient_accumulation_steps, all_batch_keys);
    if (training.global_batch_size != implied) {
      FORGE_FAIL("{} must equal training.local_batch_size × training.gradient_accumulation_steps × "
                 "data-parallel ranks (parallelism.data_parallel_shard_degree × data_parallel_replicate_degree) = {} × {} × {} = {}",
                 show_key("training.global_batch_size"), training.local_batch_size,
                 training.gradient_accumulation_steps, dp, implied);
    }
  } else if (training.global_batch_size > 0) {
    if (training.global_batch_size % samples_per_micro_step != 0) {
      FORGE_FAIL("{} must be a multiple of training.local_batch_size × data-parallel ranks "
                 "(parallelism.data_parallel_shard_degree × data_parallel_replicate_degree) = {} × {} = {}",
                 show_key("training.global_batch_size"), training.local_batch_size, dp, samples_per_micro_step);
    }
    training.gradient_accumulation_steps = training.global_batch_size / samples_per_micro_step;
  } else {
    if (training.gradient_accumulation_steps == 0) training.gradient_accumulation_steps = 1;
    training.global_batch_size = product(samples_per_micro_step, training.gradient_accumulation_steps, all_batch_keys);
  }
}

}  // namespace

// A FLUX run (NOTE [FLUX runs] in train/flux_trainer.h): a known model, an image size the
// VAE and the patches divide, data-parallel ranks only (NOTE [FLUX FSDP]), bf16 on CUDA or fp32 on the CPU, and none of the
// language-model features it does not have. flux.* values without flux.model are refused.
void check_flux(const ExperimentConfig& config, const KeyDescriber& keys) {
  const FluxRunConfig& f = config.flux;
  if (f.model.empty()) {
    // NOTE [bf16 master weights] in optim/optimizer.h: FLUX's trainer on one device.
    if (config.activation_checkpoint.recompute_blocks != -1)
      FORGE_FAIL("{}: a language model's full checkpointing recomputes every layer (this key picks a FLUX run's "
                 "blocks); remove it, or use activation_checkpoint.mode selective",
                 show(config, keys, "activation_checkpoint.recompute_blocks"));
    if (config.optimizer.master_dtype != "fp32")
      FORGE_FAIL("{}: a language model keeps fp32 master weights (bf16 weights with stochastic rounding are built "
                 "for FLUX runs on one device); remove it, or use optimizer.state_dtype bf16 to halve AdamW's moments",
                 show(config, keys, "optimizer.master_dtype"));
    // A resolved config lists every flux.* key at its default; one set to anything else
    // asks for a FLUX run.
    const FluxRunConfig d;
    const std::pair<const char*, bool> changed[] = {
        {"flux.num_double_blocks", f.num_double_blocks != d.num_double_blocks},
        {"flux.num_single_blocks", f.num_single_blocks != d.num_single_blocks},
        {"flux.resolution", f.resolution != d.resolution},
        {"flux.text_tokens", f.text_tokens != d.text_tokens},
        {"flux.guidance", f.guidance != d.guidance},
        {"flux.timestep_sampling", f.timestep_sampling != d.timestep_sampling},
        {"flux.logit_mean", f.logit_mean != d.logit_mean},
        {"flux.logit_std", f.logit_std != d.logit_std},
        {"flux.timestep_shift", f.timestep_shift != d.timestep_shift},
        {"flux.shift", f.shift != d.shift},
        {"flux.initial_load_path", f.initial_load_path != d.initial_load_path},
        {"flux.last_save_in_diffusers", f.last_save_in_diffusers != d.last_save_in_diffusers},
        {"flux.data_path", f.data_path != d.data_path},
        {"flux.eval_data_path", f.eval_data_path != d.eval_data_path},
        {"flux.weight_init", f.weight_init != d.weight_init},
        {"flux.caption_dropout_prob", f.caption_dropout_prob != d.caption_dropout_prob}};
    for (const auto& [key, differs] : changed)
      if (differs)
        FORGE_FAIL("{} sets up a FLUX run, and flux.model is empty: set flux.model ({})", show(config, keys, key),
                   fmt::join(flux_preset_names(), ", "));
    return;
  }
  if (!is_flux_preset(f.model))
    FORGE_FAIL("{}: unknown FLUX model; expected one of {}", show(config, keys, "flux.model"),
               fmt::join(flux_preset_names(), ", "));
  if (f.resolution % 16 != 0)
    FORGE_FAIL("{} must be a multiple of 16 (the VAE's 8x and the 2x2 patches)", show(config, keys, "flux.resolution"));
  // NOTE [FLUX FSDP] in distributed/flux_fsdp.h: data-parallel ranks (sharded, replicated)
  // only; the ranks the launcher started are checked against them as a language model's are.
  const ParallelismConfig& p = config.parallelism;
  for (const auto& [key, degree] : {std::pair<const char*, int64_t>{"parallelism.tensor_parallel_degree",
                                                                     p.tensor_parallel_degree},
                                    {"parallelism.context_parallel_degree", p.context_parallel_degree},
                                    {"parallelism.pipeline_parallel_degree", p.pipeline_parallel_degree},
                                    {"parallelism.expert_parallel_degree", p.expert_parallel_degree}})
    if (degree != 1)
      FORGE_FAIL("{}: a FLUX run splits its work over data-parallel ranks only (FSDP: "
                 "parallelism.data_parallel_shard_degree and data_parallel_replicate_degree); tensor, context, "
                 "pipeline and expert parallelism are the language models'",
                 show(config, keys, key));
  // NOTE [bf16 master weights] in optim/optimizer.h: bf16 moments and bf16 weights are the
  // one-device run's economies (FSDP's chunks stay fp32; the ranks already divide them).
  if (p.data_parallel_shard_degree * p.data_parallel_replicate_degree > 1)
    for (const auto& [key, value] : {std::pair<const char*, std::string>{"optimizer.state_dtype",
                                                                         config.optimizer.state_dtype},
                                     {"optimizer.master_dtype", config.optimizer.master_dtype}})
      if (value != "fp32")
        FORGE_FAIL("{}: a FLUX run under FSDP keeps fp32 master weights and moments in its chunks (the ranks divide "
                   "them); bf16 is for one device: remove it, or run on one device",
                   show(config, keys, key));
  if (config.lora.enabled() || config.precision.fp8 != "none")
    FORGE_FAIL("a FLUX run trains every weight in bf16: lora.rank ({}) and precision.fp8 ({}) are the language "
               "models'",
               config.lora.rank, config.precision.fp8);
  const std::string want = config.training.device == "cuda" ? "bf16" : "fp32";
  if (config.precision.compute_dtype != want)
    FORGE_FAIL("{}: a FLUX run on {} computes in {}", show(config, keys, "precision.compute_dtype"),
               config.training.device, want);
  if (config.activation_checkpoint.mode == "selective")
    FORGE_FAIL("{}: a FLUX run takes none or full (whole blocks)", show(config, keys, "activation_checkpoint.mode"));
  // NOTE [Recomputing some FLUX blocks] in model/flux_transformer.h.
  if (const int64_t r = config.activation_checkpoint.recompute_blocks; r != -1) {
    FluxConfig model = flux_preset(f.model);  // with a proxy's block counts
    if (f.num_double_blocks >= 0) model.num_double_blocks = f.num_double_blocks;
    if (f.num_single_blocks >= 0) model.num_single_blocks = f.num_single_blocks;
    const int64_t blocks = model.num_double_blocks + model.num_single_blocks;
    if (config.activation_checkpoint.mode != "full")
      FORGE_FAIL("{} picks the blocks full checkpointing recomputes, and {}: set activation_checkpoint.mode full, or "
                 "remove it",
                 show(config, keys, "activation_checkpoint.recompute_blocks"),
                 show(config, keys, "activation_checkpoint.mode"));
    if (r > blocks)
      FORGE_FAIL("{}: {} has {} blocks ({} double + {} single); recompute -1 (every block) or 0 to {}",
                 show(config, keys, "activation_checkpoint.recompute_blocks"), model.name, blocks,
                 model.num_double_blocks, model.num_single_blocks, blocks);
  }
  if (f.caption_dropout_prob > 0 && f.data_path.empty())
    FORGE_FAIL("{}: caption dropout replaces cached captions' encodings by the empty caption's; synthetic "
               "micro-batches have no captions: set flux.data_path to a latent cache, or flux.caption_dropout_prob 0",
               show(config, keys, "flux.caption_dropout_prob"));
  if (config.eval.interval > 0 && f.eval_data_path.empty())
    FORGE_FAIL("{}: a FLUX run evaluates on a validation latent cache: set flux.eval_data_path, or eval.interval 0",
               show(config, keys, "eval.interval"));
  // NOTE [FLUX checkpoints] in train/flux_checkpoint.h: forge checkpoints in and out; diffusers'
  // and BFL's weights through the flux.* keys.
  if (config.checkpoint.initial_load_in_hf || config.checkpoint.last_save_in_hf)
    FORGE_FAIL("{}: a FLUX run reads diffusers' or BFL's weights with flux.initial_load_path and exports with "
               "flux.last_save_in_diffusers",
               show(config, keys, config.checkpoint.initial_load_in_hf ? "checkpoint.initial_load_in_hf"
                                                                        : "checkpoint.last_save_in_hf"));
  if (!config.checkpoint.initial_load_path.empty() && !f.initial_load_path.empty())
    FORGE_FAIL("{} and {}: a FLUX run starts from one of them (a forge checkpoint, or diffusers' or BFL's weights)",
               show(config, keys, "checkpoint.initial_load_path"), show(config, keys, "flux.initial_load_path"));
  if (!f.initial_load_path.empty()) flux_weight_layout_of(f.initial_load_path);  // says what is not there
}

void validate_experiment(ExperimentConfig& config, const ConfigOrigins& origins) {
  const KeyDescriber keys = key_describer(origins);
  for (const auto& key : config_schema()) check_config_value(key, config, origin_of(origins, key.name));
  config.model.validate(keys);
  validate(config.optimizer, config.lr_scheduler, config.training.steps, keys);
  check_training(config, keys);
  check_data(config, origins, keys);
  check_checkpoint(config, keys);
  resolve_shard_degree(config, keys);
  resolve_zero_stage(config, origins);
  check_lora(config, keys);
  check_fp8(config, keys);
  check_moe(config, keys);
  check_expert_parallel(config, keys);
  check_context_parallel_degree(config, keys);
  check_tensor_parallel_degree(config, keys);
  check_mla(config, keys);
  resolve_batch(config, keys);
  check_pipeline_parallel_degree(config, keys);
  check_flux(config, keys);
}

}  // namespace forge
