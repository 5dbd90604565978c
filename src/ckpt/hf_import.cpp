#include "ckpt/hf_import.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <set>

#include "ckpt/hf_config.h"
#include "ckpt/hf_layout.h"
#include "ckpt/hf_weight_files.h"
#include "core/log.h"

namespace forge {
namespace {

bool ignorable(const std::string& name) { return name.ends_with(".rotary_emb.inv_freq"); }

std::string list_some(const std::vector<std::string>& names) {
  constexpr size_t kShown = 8;
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return out;
}

struct ArchitectureField {
  const char* key;
  std::string (*value)(const ModelConfig&);
};

// Every field that changes what the network computes, as YAML-ready text.
const std::vector<ArchitectureField>& architecture_fields() {
  static const std::vector<ArchitectureField> fields = {
      {"vocab_size", [](const ModelConfig& m) { return fmt::format("{}", m.vocab_size); }},
      {"hidden_size", [](const ModelConfig& m) { return fmt::format("{}", m.hidden_size); }},
      {"num_layers", [](const ModelConfig& m) { return fmt::format("{}", m.num_layers); }},
      {"num_heads", [](const ModelConfig& m) { return fmt::format("{}", m.num_heads); }},
      {"num_kv_heads", [](const ModelConfig& m) { return fmt::format("{}", m.num_kv_heads); }},
      {"head_dim", [](const ModelConfig& m) { return fmt::format("{}", m.resolved_head_dim()); }},
      {"ffn_hidden_size", [](const ModelConfig& m) { return fmt::format("{}", m.ffn_hidden_size); }},
      {"norm_eps", [](const ModelConfig& m) { return fmt::format("{}", m.norm_eps); }},
      {"rope_theta", [](const ModelConfig& m) { return fmt::format("{}", m.rope_theta); }},
      {"rope_scaling.enabled", [](const ModelConfig& m) { return fmt::format("{}", m.rope_scaling.enabled); }},
      {"rope_scaling.factor",
       [](const ModelConfig& m) { return m.rope_scaling.enabled ? fmt::format("{}", m.rope_scaling.factor) : ""; }},
      {"rope_scaling.low_freq_factor",
       [](const ModelConfig& m) {
         return m.rope_scaling.enabled ? fmt::format("{}", m.rope_scaling.low_freq_factor) : "";
       }},
      {"rope_scaling.high_freq_factor",
       [](const ModelConfig& m) {
         return m.rope_scaling.enabled ? fmt::format("{}", m.rope_scaling.high_freq_factor) : "";
       }},
      {"rope_scaling.original_max_position",
       [](const ModelConfig& m) {
         return m.rope_scaling.enabled ? fmt::format("{}", m.rope_scaling.original_max_position) : "";
       }},
      {"max_seq_len", [](const ModelConfig& m) { return fmt::format("{}", m.max_seq_len); }},
      {"sliding_window", [](const ModelConfig& m) { return fmt::format("{}", m.sliding_window); }},
      {"tie_word_embeddings", [](const ModelConfig& m) { return fmt::format("{}", m.tie_word_embeddings); }},
      {"num_experts", [](const ModelConfig& m) { return fmt::format("{}", m.num_experts); }},
      {"num_experts_per_tok", [](const ModelConfig& m) { return fmt::format("{}", m.num_experts_per_tok); }},
  };
  return fields;
}

// One forge parameter's Hugging Face tensors into dst (fp32), each checked: its parts, or
// the one tensor of its alias (ParamSpec::hf_alias) when the files hold that instead.
void read_parameter(const std::string& dir, const HfWeightFiles& files, const ParamSpec& spec, float* dst,
                    std::set<std::string>& used) {
  const std::vector<HfPart> parts = hf_parts(spec);
  std::vector<HfPart> read = parts;
  if (!spec.hf_alias.empty() && files.find(spec.hf_alias).file != nullptr) {
    if (LocatedTensor other = files.find(parts.front().name); other.file != nullptr)
      FORGE_FAIL("{}: holds both '{}' and '{}', two forms of forge's '{}' (transformers 5's in-memory name and the "
                 "published one); expected one of them",
                 other.file->path(), spec.hf_alias, parts.front().name, spec.name);
    read = {{spec.hf_alias, spec.shape, 0}};
  }
  for (const HfPart& part : read) {
    LocatedTensor t = files.find(part.name);
    if (t.file == nullptr)
      FORGE_FAIL("{}: no tensor '{}' in the weight files (expected {} for forge's '{}'{})", dir, part.name,
                 shape_str(part.shape), spec.name,
                 spec.hf_alias.empty() ? "" : fmt::format(", or '{}' {} whole", spec.hf_alias, shape_str(spec.shape)));
    if (t.entry->shape != part.shape)
      FORGE_FAIL("{}: tensor '{}' has shape {}, but the model's architecture needs {}", t.file->path(), part.name,
                 shape_str(t.entry->shape), shape_str(part.shape));
    t.file->read_as_float(*t.entry, dst + part.offset);
    used.insert(part.name);
  }
}

// Fails naming the tensors of the files that no parameter took.
void check_all_used(const std::string& dir, const HfWeightFiles& files, const ModelConfig& config,
                    const std::set<std::string>& used) {
  std::vector<std::string> unexpected;
  for (const LocatedTensor& t : files.all())
    if (!used.count(t.entry->name) && !ignorable(t.entry->name)) unexpected.push_back(t.entry->name);
  if (!unexpected.empty()) {
    const bool has_lm_head = std::find(unexpected.begin(), unexpected.end(), "lm_head.weight") != unexpected.end();
    const bool has_expert = std::any_of(unexpected.begin(), unexpected.end(), [](const std::string& name) {
      return name.find(".block_sparse_moe.experts.") != std::string::npos;
    });
    std::string hint = config.tie_word_embeddings && has_lm_head
                           ? " (the output is tied to the embedding, yet the files hold lm_head.weight)"
                       : config.moe() && has_expert
                           ? fmt::format(" (config.json's num_local_experts is {}: experts 0 to {})", config.num_experts,
                                         config.num_experts - 1)
                           : "";
    FORGE_FAIL("{}: {} tensor(s) that a {} model does not have: {}{}", dir, unexpected.size(),
               config.moe() ? "Mixtral" : config.sliding_window > 0 ? "Mistral" : "Llama", list_some(unexpected), hint);
  }
}

void check_architecture(const std::string& dir, const ModelConfig& config) {
  ModelConfig hf = read_hf_config(dir);
  std::vector<std::string> diffs = architecture_differences(config, hf);
  if (!diffs.empty())
    FORGE_FAIL("the configured model does not match the Hugging Face model in '{}':\n  {}\nset the model keys to "
               "match, e.g. with the overrides\n  {}",
               dir, fmt::join(diffs, "\n  "), model_overrides_for(hf));
}

}  // namespace

void load_hf_weights(const std::string& dir, FlatParameters& params) {
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "Hugging Face import writes fp32 weights in host memory");
  HfWeightFiles files(dir);
  std::set<std::string> used;
  for (size_t i = 0; i < params.specs().size(); ++i)
    read_parameter(dir, files, params.specs()[i], params.tensors()[i].data<float>(), used);
  check_all_used(dir, files, params.config(), used);
}

void for_each_hf_parameter(const std::string& dir, const ModelConfig& config,
                           const std::function<void(size_t, const Tensor&)>& consume) {
  check_architecture(dir, config);
  HfWeightFiles files(dir);
  const std::vector<ParamSpec> specs = parameter_specs(config);
  int64_t largest = 0;
  for (const ParamSpec& spec : specs) largest = std::max(largest, shape_numel(spec.shape));
  Tensor buffer = Tensor::empty({largest});
  std::set<std::string> used;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Tensor values = buffer.narrow(0, shape_numel(specs[i].shape)).view(specs[i].shape);
    read_parameter(dir, files, specs[i], values.data<float>(), used);
    consume(i, values);
  }
  check_all_used(dir, files, config, used);
  log_info("weights: {} parameters read from the Hugging Face model in {}", config.total_params(), dir);
}

HfModel load_hf_model(const std::string& dir) {
  HfModel model;
  model.config = read_hf_config(dir);
  model.params = std::make_unique<FlatParameters>(model.config);
  load_hf_weights(dir, *model.params);
  return model;
}

std::vector<std::string> architecture_differences(const ModelConfig& configured, const ModelConfig& hf) {
  std::vector<std::string> out;
  for (const auto& field : architecture_fields()) {
    std::string mine = field.value(configured), theirs = field.value(hf);
    if (mine != theirs)
      out.push_back(fmt::format("model.{}: {} here, {} in config.json", field.key, mine.empty() ? "unset" : mine,
                                theirs.empty() ? "unset" : theirs));
  }
  return out;
}

std::string model_overrides_for(const ModelConfig& hf) {
  std::string out;
  for (const auto& field : architecture_fields()) {
    std::string value = field.value(hf);
    if (!value.empty()) out += fmt::format("{}--model.{} {}", out.empty() ? "" : " ", field.key, value);
  }
  return out;
}

void load_hf_weights_checked(const std::string& dir, FlatParameters& params) {
  check_architecture(dir, params.config());
  load_hf_weights(dir, params);
  log_info("weights: {} parameters loaded from the Hugging Face model in {}", params.config().total_params(), dir);
}

}  // namespace forge
