// Hugging Face model directories as configs; see config_hf_model.h.
#include "cli/config_hf_model.h"

#include <filesystem>

#include <fmt/format.h>

#include "ckpt/hf_config.h"
#include "ckpt/hf_weight_files.h"
#include "ckpt/initial_load.h"
#include "cli/config_schema.h"
#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace {

// Each architecture key and the config.json key that sets it, for the conflict message
// (deepseek_key: DeepSeek-V2/V3's name where it differs; NOTE [DeepSeek config keys] in
// ckpt/hf_config.h).
struct ArchitectureKey {
  const char* key;
  const char* hf_key;
  const char* deepseek_key = nullptr;
};
constexpr ArchitectureKey kArchitectureKeys[] = {
    {"model.vocab_size", "vocab_size"},
    {"model.hidden_size", "hidden_size"},
    {"model.num_layers", "num_hidden_layers"},
    {"model.num_heads", "num_attention_heads"},
    {"model.num_kv_heads", "num_key_value_heads"},
    {"model.head_dim", "head_dim", "qk_nope_head_dim and qk_rope_head_dim"},
    {"model.ffn_hidden_size", "intermediate_size"},
    {"model.norm_eps", "rms_norm_eps"},
    {"model.rope_theta", "rope_theta"},
    {"model.rope_scaling.enabled", "rope_scaling.rope_type"},
    {"model.rope_scaling.type", "rope_scaling.rope_type"},
    {"model.rope_scaling.factor", "rope_scaling.factor"},
    {"model.rope_scaling.low_freq_factor", "rope_scaling.low_freq_factor"},
    {"model.rope_scaling.high_freq_factor", "rope_scaling.high_freq_factor"},
    {"model.rope_scaling.original_max_position", "rope_scaling.original_max_position_embeddings"},
    {"model.rope_scaling.beta_fast", "rope_scaling.beta_fast"},
    {"model.rope_scaling.beta_slow", "rope_scaling.beta_slow"},
    {"model.rope_scaling.mscale", "rope_scaling.mscale"},
    {"model.rope_scaling.mscale_all_dim", "rope_scaling.mscale_all_dim"},
    {"model.max_seq_len", "max_position_embeddings"},
    {"model.sliding_window", "sliding_window"},
    {"model.tie_word_embeddings", "tie_word_embeddings"},
    {"model.num_experts", "num_local_experts", "n_routed_experts"},  // 0 for Llama and Mistral
    {"model.num_experts_per_tok", "num_experts_per_tok"},
    {"model.moe_ffn_hidden_size", "moe_intermediate_size"},
    {"model.num_shared_experts", "n_shared_experts"},
    {"model.first_dense_layers", "first_k_dense_replace"},
    {"model.router_score_function", "architectures (DeepseekV3ForCausalLM: sigmoid)"},
    {"model.router_normalize_topk", "norm_topk_prob"},
    {"model.router_scaling_factor", "routed_scaling_factor"},
    {"model.router_num_groups", "n_group"},
    {"model.router_topk_groups", "topk_group"},
    {"model.q_lora_rank", "q_lora_rank"},
    {"model.kv_lora_rank", "kv_lora_rank"},
    {"model.qk_nope_head_dim", "qk_nope_head_dim"},
    {"model.qk_rope_head_dim", "qk_rope_head_dim"},
    {"model.v_head_dim", "v_head_dim"},
};

// Whether a model.rope_scaling key is architecture here: enabled always; the others when
// either side scales RoPE, the ones of one scaling type (llama3's low/high_freq_factor,
// YaRN's beta_fast, beta_slow, mscale, mscale_all_dim) when either side uses that type.
bool rope_key_applies(std::string_view key, const RopeScaling& a, const RopeScaling& b) {
  if (!key.starts_with("model.rope_scaling.") || key == "model.rope_scaling.enabled") return true;
  auto llama3 = [](const RopeScaling& s) { return s.enabled && !s.yarn(); };
  if (key.ends_with("_freq_factor")) return llama3(a) || llama3(b);
  if (key.starts_with("model.rope_scaling.beta_") || key.starts_with("model.rope_scaling.mscale"))
    return a.yarn() || b.yarn();
  return a.enabled || b.enabled;
}

// The value a key has in `config`, as the YAML text to_yaml writes; head_dim resolved
// (0 and the derived size are the same architecture).
std::string value_text(const ExperimentConfig& config, const std::string& key) {
  if (key == "model.head_dim") return fmt::format("{}", config.model.resolved_head_dim());
  return format_config_value(*find_config_key(key), config);
}

bool parse_in_hf(const ConfigSetting& setting) {
  ExperimentConfig scratch;
  set_config_value(*find_config_key(setting.key), scratch, setting.value, setting.where);
  return scratch.checkpoint.initial_load_in_hf;
}

const char* export_dtype_of(SafetensorsDType stored) {
  switch (stored) {
    case SafetensorsDType::BF16: return "bf16";
    case SafetensorsDType::F16: return "fp16";
    default: return "fp32";
  }
}

}  // namespace

std::optional<HfStart> find_hf_start(const ConfigSetting* path, const ConfigSetting* in_hf) {
  if (path == nullptr || path->value.empty()) return std::nullopt;
  const std::string key = fmt::format("checkpoint.initial_load_path ({})", path->where);
  const std::optional<bool> explicit_hf = in_hf ? std::optional<bool>(parse_in_hf(*in_hf)) : std::nullopt;
  if (explicit_hf != true) {
    std::error_code error;
    if (!std::filesystem::exists(path->value, error)) return std::nullopt;
    if (classify_initial_load(path->value, key) == InitialLoadKind::ForgeCheckpoint) return std::nullopt;
    if (explicit_hf == false)
      FORGE_FAIL("{}: checkpoint.initial_load_in_hf is false, but {} '{}' is a Hugging Face model directory "
                 "(config.json, no forge checkpoint); drop checkpoint.initial_load_in_hf or set it true",
                 in_hf->where, key, path->value);
  }
  return HfStart{path->value, path->where, read_hf_config(path->value)};
}

std::string hf_config_origin(const HfStart& start) {
  return (std::filesystem::path(start.dir) / "config.json").string();
}

void check_hf_model_conflicts(const ExperimentConfig& config, const HfStart& start, const ConfigOrigins& origins) {
  ExperimentConfig hf;
  hf.model = start.model;
  for (const auto& [key, hf_key, deepseek_key] : kArchitectureKeys) {
    const auto origin = origins.find(key);
    if (origin == origins.end() || origin->second == hf_config_origin(start)) continue;
    if (!rope_key_applies(key, config.model.rope_scaling, hf.model.rope_scaling)) continue;
    const std::string mine = value_text(config, key), theirs = value_text(hf, key);
    if (mine == theirs) continue;
    const std::string hint =
        key == std::string("model.max_seq_len")
            ? "; to train on longer sequences than the model was built for, set training.allow_longer_seq_len true"
            : "";
    FORGE_FAIL("{}: {} = {} conflicts with the Hugging Face model that checkpoint.initial_load_path ({}) starts "
               "from: {} ({}) gives {}; remove the key or set it to {}{}",
               origin->second, key, mine, start.origin, hf_config_origin(start),
               hf.model.mla() && deepseek_key ? deepseek_key : hf_key, theirs, theirs, hint);
  }
}

std::string default_export_dtype(const std::optional<HfStart>& start) {
  if (!start) return "bf16";
  const std::string path = (std::filesystem::path(start->dir) / "config.json").string();
  const std::string declared = hf_declared_dtype(read_json_file(path, "the model's config.json"), path);
  if (declared == "bfloat16") return "bf16";
  if (declared == "float16") return "fp16";
  if (declared == "float32") return "fp32";
  HfWeightFiles files(start->dir);
  for (const LocatedTensor& t : files.all()) return export_dtype_of(t.entry->dtype);
  return "fp32";
}

}  // namespace forge
