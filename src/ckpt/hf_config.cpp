#include "ckpt/hf_config.h"

#include <filesystem>

#include "core/checked_math.h"
#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace {

using nlohmann::json;

// Typed access to config.json keys; every error names the file and the key.
class HfConfigReader {
 public:
  HfConfigReader(const json& config, const std::string& path) : config_(config), path_(path) {}

  bool has(const char* key) const { return config_.contains(key) && !config_[key].is_null(); }

  int64_t positive_int(const char* key) const {
    if (!has(key)) FORGE_FAIL("{}: \"{}\" is missing (expected a positive integer)", path_, key);
    return positive_int_or(key, 0);
  }
  int64_t positive_int_or(const char* key, int64_t fallback) const {
    if (!has(key)) return fallback;
    const json& v = config_[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 1)
      FORGE_FAIL("{}: \"{}\" is {}, expected a positive integer", path_, key, describe_json(v));
    return v.get<int64_t>();
  }
  double positive_number_or(const json& object, const char* key, double fallback, const std::string& where) const {
    if (!object.contains(key) || object[key].is_null()) return fallback;
    const json& v = object[key];
    if (!v.is_number() || !(v.get<double>() > 0))
      FORGE_FAIL("{}: \"{}{}\" is {}, expected a positive number", path_, where, key, describe_json(v));
    return v.get<double>();
  }
  double non_negative_number_or(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    const json& v = config_[key];
    if (!v.is_number() || !(v.get<double>() >= 0))
      FORGE_FAIL("{}: \"{}\" is {}, expected a number >= 0", path_, key, describe_json(v));
    return v.get<double>();
  }
  bool boolean_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!config_[key].is_boolean()) FORGE_FAIL("{}: \"{}\" is {}, expected true or false", path_, key, describe_json(config_[key]));
    return config_[key].get<bool>();
  }
  std::string string_or(const json& object, const char* key, const std::string& fallback, const std::string& where) const {
    if (!object.contains(key) || object[key].is_null()) return fallback;
    if (!object[key].is_string())
      FORGE_FAIL("{}: \"{}{}\" is {}, expected a string", path_, where, key, describe_json(object[key]));
    return object[key].get<std::string>();
  }
  const json& config() const { return config_; }
  const std::string& path() const { return path_; }

 private:
  const json& config_;
  const std::string& path_;
};

std::string model_family(const HfConfigReader& r) {
  const json& c = r.config();
  if (r.has("architectures")) {
    const json& archs = c["architectures"];
    if (!archs.is_array() || archs.size() != 1 || !archs[0].is_string())
      FORGE_FAIL("{}: \"architectures\" is {}, expected a list with one name", r.path(), describe_json(archs));
    std::string arch = archs[0].get<std::string>();
    if (arch == "LlamaForCausalLM") return "llama";
    if (arch == "MistralForCausalLM") return "mistral";
    if (arch == "MixtralForCausalLM") return "mixtral";
    FORGE_FAIL("{}: \"architectures\" is [\"{}\"]; forge imports LlamaForCausalLM, MistralForCausalLM and "
               "MixtralForCausalLM",
               r.path(), arch);
  }
  std::string type = r.string_or(c, "model_type", "", "");
  if (type == "llama" || type == "mistral" || type == "mixtral") return type;
  FORGE_FAIL("{}: no \"architectures\" and \"model_type\" is '{}'; forge imports Llama, Mistral and Mixtral models",
             r.path(), type);
}

void reject_unsupported(const HfConfigReader& r) {
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (r.boolean_or(key, false))
      FORGE_FAIL("{}: \"{}\" is true; forge's Llama has no bias terms", r.path(), key);
  std::string act = r.string_or(r.config(), "hidden_act", "silu", "");
  if (act != "silu") FORGE_FAIL("{}: \"hidden_act\" is '{}'; forge's MLP is SwiGLU and needs \"silu\"", r.path(), act);
}

// Mixtral's experts (NOTE [Mixtral config keys] in hf_config.h).
void read_experts(const HfConfigReader& r, ModelConfig& m) {
  m.num_experts = r.positive_int_or("num_local_experts", 8);
  m.num_experts_per_tok = r.positive_int_or("num_experts_per_tok", 2);
  const double coefficient = r.non_negative_number_or("router_aux_loss_coef", 0.001);
  m.router_aux_loss_coef = r.boolean_or("output_router_logits", false) ? coefficient : 0.0;
  if (const double jitter = r.non_negative_number_or("router_jitter_noise", 0.0); jitter != 0.0)
    FORGE_FAIL("{}: \"router_jitter_noise\" is {}; forge's router has no jitter (expected 0)", r.path(), jitter);
}

// RoPE, as transformers resolves it: legacy rope_scaling wins over rope_parameters;
// rope_theta from inside the dict, else the top level, else the family's default_theta.
void read_rope(const HfConfigReader& r, ModelConfig& m, double default_theta) {
  const json& c = r.config();
  std::string where = "rope_parameters";
  json rope = json::object();
  if (r.has("rope_scaling") && !c["rope_scaling"].empty()) {
    rope = c["rope_scaling"];
    where = "rope_scaling";
  } else if (r.has("rope_parameters")) {
    rope = c["rope_parameters"];
  }
  if (!rope.is_object()) FORGE_FAIL("{}: \"{}\" is {}, expected an object", r.path(), where, describe_json(rope));
  const std::string prefix = where + ".";
  const double top_theta = r.positive_number_or(c, "rope_theta", default_theta, "");
  m.rope_theta = r.positive_number_or(rope, "rope_theta", top_theta, prefix);
  std::string type = r.string_or(rope, "rope_type", r.string_or(rope, "type", "default", prefix), prefix);
  if (rope.contains("partial_rotary_factor") && rope["partial_rotary_factor"] != 1.0)
    FORGE_FAIL("{}: \"{}partial_rotary_factor\" is {}; forge rotates the whole head", r.path(), prefix,
               describe_json(rope["partial_rotary_factor"]));
  if (type == "default") return;
  if (type != "llama3")
    FORGE_FAIL("{}: \"{}rope_type\" is '{}'; forge supports \"default\" and \"llama3\"", r.path(), prefix, type);
  for (const char* key : {"factor", "low_freq_factor", "high_freq_factor"})
    if (!rope.contains(key)) FORGE_FAIL("{}: \"{}{}\" is missing (required by rope_type llama3)", r.path(), prefix, key);
  m.rope_scaling.enabled = true;
  m.rope_scaling.factor = r.positive_number_or(rope, "factor", 0, prefix);
  m.rope_scaling.low_freq_factor = r.positive_number_or(rope, "low_freq_factor", 0, prefix);
  m.rope_scaling.high_freq_factor = r.positive_number_or(rope, "high_freq_factor", 0, prefix);
  const json& original = rope.contains("original_max_position_embeddings") ? rope["original_max_position_embeddings"]
                                                                            : json(m.max_seq_len);
  if (!original.is_number_integer() || original.get<int64_t>() < 1)
    FORGE_FAIL("{}: \"{}original_max_position_embeddings\" is {}, expected a positive integer", r.path(), prefix,
               describe_json(original));
  m.rope_scaling.original_max_position = original.get<int64_t>();
}

}  // namespace

ModelConfig model_config_from_hf(const json& config, const std::string& path) {
  if (!config.is_object()) FORGE_FAIL("{}: expected a JSON object, got {}", path, config.type_name());
  HfConfigReader r(config, path);
  const std::string family = model_family(r);
  reject_unsupported(r);

  const bool mixtral = family == "mixtral";
  ModelConfig m;
  m.vocab_size = r.positive_int("vocab_size");
  m.hidden_size = r.positive_int("hidden_size");
  m.ffn_hidden_size = r.positive_int("intermediate_size");
  m.num_layers = r.positive_int("num_hidden_layers");
  m.num_heads = r.positive_int("num_attention_heads");
  m.num_kv_heads = r.positive_int_or("num_key_value_heads", mixtral ? 8 : m.num_heads);
  const int64_t head_dim = r.positive_int_or("head_dim", m.hidden_size / m.num_heads);
  m.head_dim = checked_mul(head_dim, m.num_heads) == m.hidden_size ? 0 : head_dim;
  m.norm_eps = r.positive_number_or(config, "rms_norm_eps", mixtral ? 1e-5 : 1e-6, "");
  m.max_seq_len = r.positive_int_or("max_position_embeddings", family == "llama" ? 2048 : 4096 * 32);
  m.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  if (family == "mistral") {
    // MistralConfig defaults sliding_window to 4096 when the key is absent; null means none.
    m.sliding_window = config.contains("sliding_window") ? r.positive_int_or("sliding_window", 0) : 4096;
  } else if (mixtral) {
    m.sliding_window = r.positive_int_or("sliding_window", 0);  // MixtralConfig's default: none
  }
  if (mixtral) read_experts(r, m);
  read_rope(r, m, mixtral ? 1e6 : 10000.0);
  if (r.has("initializer_range")) m.init_std = r.positive_number_or(config, "initializer_range", m.init_std, "");
  try {
    m.validate();
  } catch (const Error& e) {
    FORGE_FAIL("{}: not a model forge can build: {}", path, e.what());
  }
  return m;
}

std::string hf_model_family(const json& config, const std::string& path) {
  if (!config.is_object()) FORGE_FAIL("{}: expected a JSON object, got {}", path, config.type_name());
  return model_family(HfConfigReader(config, path));
}

std::string hf_declared_dtype(const json& config, const std::string& path) {
  for (const char* key : {"dtype", "torch_dtype"}) {
    if (!config.is_object() || !config.contains(key) || config[key].is_null()) continue;
    const json& v = config[key];
    if (v.is_string() && (v == "float32" || v == "bfloat16" || v == "float16")) return v.get<std::string>();
    FORGE_FAIL("{}: \"{}\" is {}, expected \"float32\", \"bfloat16\" or \"float16\"", path, key, describe_json(v));
  }
  return "";
}

ModelConfig read_hf_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::exists(path))
    FORGE_FAIL("{}: not found (is '{}' a Hugging Face model directory?)", path, dir);
  json config = read_json_file(path, "the model's config.json");
  ModelConfig m = model_config_from_hf(config, path);
  m.name = hf_model_name(dir);
  return m;
}

bool is_hf_model_dir(const std::string& dir) {
  std::error_code error;
  return std::filesystem::exists(std::filesystem::path(dir) / "config.json", error);
}

std::string hf_model_name(const std::string& dir) {
  std::filesystem::path path = std::filesystem::path(dir).lexically_normal();
  if (!path.has_filename()) path = path.parent_path();
  if (path.filename().empty() || path.filename() == "." || path.filename() == "..")
    path = std::filesystem::absolute(path).lexically_normal();
  const std::string repo = path.parent_path().parent_path().filename().string();
  if (path.parent_path().filename() == "snapshots" && repo.starts_with("models--"))
    return repo.substr(repo.rfind("--") + 2);
  return path.filename().string();
}

nlohmann::ordered_json hf_config_from_model(const ModelConfig& m, const std::string& dtype, const std::string& family) {
  FORGE_CHECK(family.empty() || family == "llama" || family == "mistral" || family == "mixtral",
              "unknown model family '{}'", family);
  FORGE_CHECK(family != "llama" || m.sliding_window == 0, "a Llama model has no sliding window");
  FORGE_CHECK(family.empty() || m.moe() == (family == "mixtral"), "a {} model cannot be written as a {} model",
              m.moe() ? "Mixture-of-Experts" : "dense", family);
  // A MoE model is always Mixtral (with or without a sliding window).
  const bool mixtral = m.moe();
  const bool mistral = !mixtral && (family.empty() ? m.sliding_window > 0 : family == "mistral");
  const char* architecture = mixtral ? "MixtralForCausalLM" : mistral ? "MistralForCausalLM" : "LlamaForCausalLM";
  nlohmann::ordered_json rope = {{"rope_theta", m.rope_theta}, {"rope_type", m.rope_scaling.enabled ? "llama3" : "default"}};
  if (m.rope_scaling.enabled) {
    rope["factor"] = m.rope_scaling.factor;
    rope["low_freq_factor"] = m.rope_scaling.low_freq_factor;
    rope["high_freq_factor"] = m.rope_scaling.high_freq_factor;
    rope["original_max_position_embeddings"] = m.rope_scaling.original_max_position;
  }
  nlohmann::ordered_json c;
  c["architectures"] = {architecture};
  c["model_type"] = mixtral ? "mixtral" : mistral ? "mistral" : "llama";
  c["vocab_size"] = m.vocab_size;
  c["hidden_size"] = m.hidden_size;
  c["intermediate_size"] = m.ffn_hidden_size;
  c["num_hidden_layers"] = m.num_layers;
  c["num_attention_heads"] = m.num_heads;
  c["num_key_value_heads"] = m.num_kv_heads;
  c["head_dim"] = m.resolved_head_dim();
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = m.norm_eps;
  c["max_position_embeddings"] = m.max_seq_len;
  c["rope_parameters"] = rope;
  // The same RoPE in the keys transformers 4.x, vLLM and conversion scripts read.
  c["rope_theta"] = m.rope_theta;
  nlohmann::ordered_json legacy_scaling = rope;
  legacy_scaling.erase("rope_theta");
  c["rope_scaling"] = m.rope_scaling.enabled ? legacy_scaling : nlohmann::ordered_json(nullptr);
  if (mistral || mixtral) {
    c["sliding_window"] = m.sliding_window > 0 ? nlohmann::ordered_json(m.sliding_window) : nlohmann::ordered_json(nullptr);
  } else {
    c["attention_bias"] = false;
    c["mlp_bias"] = false;
  }
  if (mixtral) {  // NOTE [Mixtral config keys] in hf_config.h
    c["num_local_experts"] = m.num_experts;
    c["num_experts_per_tok"] = m.num_experts_per_tok;
    c["output_router_logits"] = m.router_aux_loss_coef > 0;
    if (m.router_aux_loss_coef > 0) c["router_aux_loss_coef"] = m.router_aux_loss_coef;
    c["router_jitter_noise"] = 0.0;
  }
  c["attention_dropout"] = 0.0;
  c["tie_word_embeddings"] = m.tie_word_embeddings;
  c["initializer_range"] = m.init_std;
  c["use_cache"] = true;
  c["dtype"] = dtype;
  c["torch_dtype"] = dtype;  // the name transformers 4.x reads
  return c;
}

}  // namespace forge
