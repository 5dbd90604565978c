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

// Each architecture key and the config.json key that sets it, for the conflict message.
struct ArchitectureKey {
  const char* key;
  const char* hf_key;
};
constexpr ArchitectureKey kArchitectureKeys[] = {
    {"model.vocab_size", "vocab_size"},
    {"model.hidden_size", "hidden_size"},
    {"model.num_layers", "num_hidden_layers"},
    {"model.num_heads", "num_attention_heads"},
    {"model.num_kv_heads", "num_key_value_heads"},
    {"model.head_dim", "head_dim"},
    {"model.ffn_hidden_size", "intermediate_size"},
    {"model.norm_eps", "rms_norm_eps"},
    {"model.rope_theta", "rope_theta"},
    {"model.rope_scaling.enabled", "rope_scaling.rope_type"},
    {"model.rope_scaling.factor", "rope_scaling.factor"},
    {"model.rope_scaling.low_freq_factor", "rope_scaling.low_freq_factor"},
    {"model.rope_scaling.high_freq_factor", "rope_scaling.high_freq_factor"},
    {"model.rope_scaling.original_max_position", "rope_scaling.original_max_position_embeddings"},
    {"model.max_seq_len", "max_position_embeddings"},
    {"model.sliding_window", "sliding_window"},
    {"model.tie_word_embeddings", "tie_word_embeddings"},
    {"model.num_experts", "num_local_experts"},  // 0 for Llama and Mistral
    {"model.num_experts_per_tok", "num_experts_per_tok"},
};

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
  const bool scaled = config.model.rope_scaling.enabled || hf.model.rope_scaling.enabled;
  for (const auto& [key, hf_key] : kArchitectureKeys) {
    const auto origin = origins.find(key);
    if (origin == origins.end() || origin->second == hf_config_origin(start)) continue;
    if (std::string_view(key).starts_with("model.rope_scaling.") && key != std::string("model.rope_scaling.enabled") &&
        !scaled)
      continue;
    const std::string mine = value_text(config, key), theirs = value_text(hf, key);
    if (mine == theirs) continue;
    const std::string hint =
        key == std::string("model.max_seq_len")
            ? "; to train on longer sequences than the model was built for, set training.allow_longer_seq_len true"
            : "";
    FORGE_FAIL("{}: {} = {} conflicts with the Hugging Face model that checkpoint.initial_load_path ({}) starts "
               "from: {} ({}) gives {}; remove the key or set it to {}{}",
               origin->second, key, mine, start.origin, hf_config_origin(start),
               hf_key, theirs, theirs, hint);
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
