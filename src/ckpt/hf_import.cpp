#include "ckpt/hf_import.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>

#include "ckpt/hf_config.h"
#include "ckpt/hf_layout.h"
#include "ckpt/hf_weight_files.h"
#include "core/json_input.h"
#include "core/log.h"

namespace forge {
namespace {

// Tensors of the files that no parameter takes and that are not an error: the rotary
// inv_freq buffers some exporters save, the empty shared experts transformers writes for
// DeepSeek blocks without them (hf_empty_parts, with exactly their shapes), and DeepSeek-V3's
// multi-token-prediction blocks (HfWeightLayout::extra_layers).
class Ignorable {
 public:
  Ignorable(const ModelConfig& config, const HfWeightLayout& layout) {
    for (const HfPart& part : hf_empty_parts(config)) empty_[part.name] = part.shape;
    for (int64_t i = 0; i < layout.extra_layers; ++i)
      extra_prefixes_.push_back(fmt::format("model.layers.{}.", config.num_layers + i));
  }
  bool operator()(const SafetensorsEntry& t) const {
    if (t.name.ends_with(".rotary_emb.inv_freq")) return true;
    if (auto it = empty_.find(t.name); it != empty_.end()) return t.shape == it->second;
    return extra_layer(t.name);
  }
  bool extra_layer(const std::string& name) const {
    return std::any_of(extra_prefixes_.begin(), extra_prefixes_.end(),
                       [&](const std::string& prefix) { return name.starts_with(prefix); });
  }

 private:
  std::map<std::string, Shape> empty_;
  std::vector<std::string> extra_prefixes_;
};

// The family's name in messages.
std::string model_kind(const ModelConfig& config) {
  if (config.mla()) return config.moe() && config.router_score_function == "sigmoid" ? "DeepSeek-V3" : "DeepSeek-V2";
  return config.moe() ? "Mixtral" : config.sliding_window > 0 ? "Mistral" : "Llama";
}

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

bool llama3(const ModelConfig& m) { return m.rope_scaling.enabled && !m.rope_scaling.yarn(); }

// The MoE routing and MLA fields are text only for a model that has them, so a Llama's
// differences and overrides do not list a dozen defaults.
// (F: a captureless lambda, default-constructible.)
template <typename F>
constexpr auto moe_field(F) {
  return +[](const ModelConfig& m) { return m.moe() ? F{}(m) : std::string(); };
}
template <typename F>
constexpr auto mla_field(F) {
  return +[](const ModelConfig& m) { return m.mla() ? F{}(m) : std::string(); };
}

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
      {"rope_scaling.type",
       [](const ModelConfig& m) { return m.rope_scaling.enabled ? m.rope_scaling.type : std::string(); }},
      {"rope_scaling.factor",
       [](const ModelConfig& m) { return m.rope_scaling.enabled ? fmt::format("{}", m.rope_scaling.factor) : ""; }},
      {"rope_scaling.low_freq_factor",
       [](const ModelConfig& m) {
         return llama3(m) ? fmt::format("{}", m.rope_scaling.low_freq_factor) : "";
       }},
      {"rope_scaling.high_freq_factor",
       [](const ModelConfig& m) {
         return llama3(m) ? fmt::format("{}", m.rope_scaling.high_freq_factor) : "";
       }},
      {"rope_scaling.original_max_position",
       [](const ModelConfig& m) {
         return m.rope_scaling.enabled ? fmt::format("{}", m.rope_scaling.original_max_position) : "";
       }},
      {"rope_scaling.beta_fast",
       [](const ModelConfig& m) { return m.rope_scaling.yarn() ? fmt::format("{}", m.rope_scaling.beta_fast) : ""; }},
      {"rope_scaling.beta_slow",
       [](const ModelConfig& m) { return m.rope_scaling.yarn() ? fmt::format("{}", m.rope_scaling.beta_slow) : ""; }},
      {"rope_scaling.mscale",
       [](const ModelConfig& m) { return m.rope_scaling.yarn() ? fmt::format("{}", m.rope_scaling.mscale) : ""; }},
      {"rope_scaling.mscale_all_dim",
       [](const ModelConfig& m) {
         return m.rope_scaling.yarn() ? fmt::format("{}", m.rope_scaling.mscale_all_dim) : "";
       }},
      {"max_seq_len", [](const ModelConfig& m) { return fmt::format("{}", m.max_seq_len); }},
      {"sliding_window", [](const ModelConfig& m) { return fmt::format("{}", m.sliding_window); }},
      {"tie_word_embeddings", [](const ModelConfig& m) { return fmt::format("{}", m.tie_word_embeddings); }},
      {"num_experts", [](const ModelConfig& m) { return fmt::format("{}", m.num_experts); }},
      {"num_experts_per_tok", [](const ModelConfig& m) { return fmt::format("{}", m.num_experts_per_tok); }},
      // DeepSeek's experts and routing, for a MoE model (the defaults otherwise).
      {"moe_ffn_hidden_size", moe_field([](const ModelConfig& m) { return fmt::format("{}", m.moe_ffn_hidden_size); })},
      {"num_shared_experts", moe_field([](const ModelConfig& m) { return fmt::format("{}", m.num_shared_experts); })},
      {"first_dense_layers", moe_field([](const ModelConfig& m) { return fmt::format("{}", m.first_dense_layers); })},
      {"router_score_function", moe_field([](const ModelConfig& m) { return m.router_score_function; })},
      {"router_normalize_topk",
       moe_field([](const ModelConfig& m) { return fmt::format("{}", m.router_normalize_topk); })},
      {"router_scaling_factor",
       moe_field([](const ModelConfig& m) { return fmt::format("{}", m.router_scaling_factor); })},
      {"router_num_groups", moe_field([](const ModelConfig& m) { return fmt::format("{}", m.router_num_groups); })},
      {"router_topk_groups", moe_field([](const ModelConfig& m) { return fmt::format("{}", m.router_topk_groups); })},
      // Multi-head Latent Attention's dims, for an MLA model (0 otherwise).
      {"kv_lora_rank", [](const ModelConfig& m) { return fmt::format("{}", m.kv_lora_rank); }},
      {"q_lora_rank", mla_field([](const ModelConfig& m) { return fmt::format("{}", m.q_lora_rank); })},
      {"qk_nope_head_dim", mla_field([](const ModelConfig& m) { return fmt::format("{}", m.qk_nope_head_dim); })},
      {"qk_rope_head_dim", mla_field([](const ModelConfig& m) { return fmt::format("{}", m.qk_rope_head_dim); })},
      {"v_head_dim", mla_field([](const ModelConfig& m) { return fmt::format("{}", m.v_head_dim); })},
  };
  return fields;
}

// Rows of a part read in the tensor's order put in forge's (HfPart::row_order).
void reorder_rows(const HfPart& part, float* rows) {
  if (part.row_order.empty()) return;
  const int64_t row = shape_numel(part.shape) / part.shape[0];
  const std::vector<float> stored(rows, rows + shape_numel(part.shape));
  for (size_t r = 0; r < part.row_order.size(); ++r)
    std::copy_n(stored.data() + static_cast<int64_t>(r) * row, row, rows + part.row_order[r] * row);
}

// One forge parameter's Hugging Face tensors into dst (fp32), each checked: its parts, or
// the one tensor of its alias (ParamSpec::hf_alias) when the files hold that instead. With
// `runs` (a tensor-parallel rank's shard of it: tensor_parallel_runs) only the elements of
// the runs are read, each to its place in the shard. dst null: checked (present, with its
// shape) and counted as used, not read (another pipeline stage's parameter).
void read_parameter(const std::string& dir, const HfWeightFiles& files, const ParamSpec& spec,
                    const HfWeightLayout& layout, float* dst, std::set<std::string>& used,
                    const std::vector<ShardRun>& runs = {}) {
  const std::vector<HfPart> parts = hf_parts(spec, layout.interleaved_rotary);
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
    used.insert(part.name);
    if (dst == nullptr) continue;
    if (runs.empty()) {
      t.file->read_as_float(*t.entry, dst + part.offset);
      reorder_rows(part, dst + part.offset);
      continue;
    }
    FORGE_CHECK(part.row_order.empty(), "'{}': rows reordered at import cannot be split over tensor-parallel ranks",
                part.name);
    const int64_t part_end = part.offset + shape_numel(part.shape);
    for (const ShardRun& run : runs) {
      const int64_t from = std::max(part.offset, run.full_begin), to = std::min(part_end, run.full_begin + run.count);
      if (from < to)
        t.file->read_as_float(*t.entry, dst + run.local_begin + (from - run.full_begin), from - part.offset, to - from);
    }
  }
}

// Fails naming the tensors of the files that no parameter took.
void check_all_used(const std::string& dir, const HfWeightFiles& files, const ModelConfig& config,
                    const HfWeightLayout& layout, const std::set<std::string>& used) {
  const Ignorable ignorable(config, layout);
  std::vector<std::string> unexpected;
  size_t extra_layer_tensors = 0;
  for (const LocatedTensor& t : files.all()) {
    if (used.count(t.entry->name)) continue;
    if (!ignorable(*t.entry)) unexpected.push_back(t.entry->name);
    else extra_layer_tensors += ignorable.extra_layer(t.entry->name);
  }
  if (extra_layer_tensors > 0)
    log_info("weights: {} tensor(s) of the multi-token-prediction block(s) after the last (num_nextn_predict_layers {}) "
             "not read: forge does not train them",
             extra_layer_tensors, layout.extra_layers);
  if (!unexpected.empty()) {
    const bool has_lm_head = std::find(unexpected.begin(), unexpected.end(), "lm_head.weight") != unexpected.end();
    const bool has_expert = std::any_of(unexpected.begin(), unexpected.end(), [](const std::string& name) {
      return name.find(".block_sparse_moe.experts.") != std::string::npos ||
             name.find(".mlp.experts.") != std::string::npos;
    });
    const char* experts_key = config.mla() ? "n_routed_experts" : "num_local_experts";
    std::string hint = config.tie_word_embeddings && has_lm_head
                           ? " (the output is tied to the embedding, yet the files hold lm_head.weight)"
                       : config.moe() && has_expert
                           ? fmt::format(" (config.json's {} is {}: experts 0 to {})", experts_key, config.num_experts,
                                         config.num_experts - 1)
                           : "";
    FORGE_FAIL("{}: {} tensor(s) that a {} model does not have: {}{}", dir, unexpected.size(), model_kind(config),
               list_some(unexpected), hint);
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

HfWeightLayout read_weight_layout(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::exists(path)) return {};
  return hf_weight_layout(read_json_file(path, "the model's config.json"), path);
}

void load_hf_weights(const std::string& dir, FlatParameters& params) {
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "Hugging Face import writes fp32 weights in host memory");
  const HfWeightLayout layout = read_weight_layout(dir);
  HfWeightFiles files(dir);
  std::set<std::string> used;
  for (size_t i = 0; i < params.specs().size(); ++i)
    read_parameter(dir, files, params.specs()[i], layout, params.tensors()[i].data<float>(), used);
  check_all_used(dir, files, params.config(), layout, used);
}

void for_each_hf_parameter(const std::string& dir, const ModelConfig& config,
                           const std::function<void(size_t, const Tensor&)>& consume, TensorParallelShard shard,
                           const std::vector<PipelineStage>& stages) {
  check_architecture(dir, config);
  const HfWeightLayout layout = read_weight_layout(dir);
  HfWeightFiles files(dir);
  const std::vector<ParamSpec> specs = parameter_specs(config), held = parameter_specs(config, shard);
  // NOTE [Pipeline stages]: a pipeline rank reads its stages' parameters alone.
  std::set<std::string> in_stages;
  for (const ParamSpec& spec : pipeline_stage_specs(specs, stages)) in_stages.insert(spec.name);
  int64_t largest = 0, read = 0;
  for (const ParamSpec& spec : held)
    if (in_stages.count(spec.name)) largest = std::max(largest, shape_numel(spec.shape));
  Tensor buffer = Tensor::empty({largest});
  std::set<std::string> used;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!in_stages.count(specs[i].name)) {
      read_parameter(dir, files, specs[i], layout, nullptr, used);  // every rank checks the whole model
      continue;
    }
    const Tensor values = buffer.narrow(0, shape_numel(held[i].shape)).view(held[i].shape);
    const std::vector<ShardRun> runs = shard.size > 1 ? tensor_parallel_runs(specs[i], shard) : std::vector<ShardRun>{};
    read_parameter(dir, files, specs[i], layout, values.data<float>(), used, runs);
    consume(i, values);
    read += shape_numel(specs[i].shape);
  }
  check_all_used(dir, files, config, layout, used);
  if (!stages.empty())
    log_info("weights: this rank's pipeline stages, {} of the {} parameters, read{} from the Hugging Face model in {}",
             read, config.total_params(),
             shard.size > 1
                 ? fmt::format(" (tensor-parallel rank {} of {}: its shards of them)", shard.rank, shard.size)
                 : "",
             dir);
  else if (shard.size > 1)
    log_info("weights: tensor-parallel rank {} of {} read its shards of the {} parameters of the Hugging Face model in "
             "{}",
             shard.rank, shard.size, config.total_params(), dir);
  else
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
