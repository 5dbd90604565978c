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
  int64_t non_negative_int_or(const char* key, int64_t fallback) const {
    if (!has(key)) return fallback;
    const json& v = config_[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0)
      FORGE_FAIL("{}: \"{}\" is {}, expected an integer >= 0", path_, key, describe_json(v));
    return v.get<int64_t>();
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
  double positive_number_or(const char* key, double fallback) const {
    return positive_number_or(config_, key, fallback, "");
  }
  // A key DeepSeek's own code reads and transformers ignores: absent, null or `expected`.
  void expect_string(const char* key, const char* expected, const std::string& why) const {
    const std::string value = string_or(config_, key, expected, "");
    if (value != expected)
      FORGE_FAIL("{}: \"{}\" is '{}'; {} (expected \"{}\")", path_, key, value, why, expected);
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
    if (arch == "DeepseekV2ForCausalLM") return "deepseek_v2";
    if (arch == "DeepseekV3ForCausalLM") return "deepseek_v3";
    FORGE_FAIL("{}: \"architectures\" is [\"{}\"]; forge imports LlamaForCausalLM, MistralForCausalLM, "
               "MixtralForCausalLM, DeepseekV2ForCausalLM and DeepseekV3ForCausalLM",
               r.path(), arch);
  }
  std::string type = r.string_or(c, "model_type", "", "");
  if (type == "llama" || type == "mistral" || type == "mixtral" || type == "deepseek_v2" || type == "deepseek_v3")
    return type;
  FORGE_FAIL("{}: no \"architectures\" and \"model_type\" is '{}'; forge imports Llama, Mistral, Mixtral and "
             "DeepSeek-V2/V3 models",
             r.path(), type);
}

bool is_deepseek(const std::string& family) { return family == "deepseek_v2" || family == "deepseek_v3"; }

void reject_unsupported(const HfConfigReader& r) {
  for (const char* key : {"attention_bias", "mlp_bias"})
    if (r.boolean_or(key, false))
      FORGE_FAIL("{}: \"{}\" is true; forge's projections have no bias terms", r.path(), key);
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

// Multi-head Latent Attention's keys (NOTE [DeepSeek config keys] in hf_config.h).
void read_latent_attention(const HfConfigReader& r, ModelConfig& m, bool v3) {
  const bool kv_heads_given = r.has("num_key_value_heads");
  m.num_kv_heads = r.positive_int_or("num_key_value_heads", v3 ? 128 : m.num_heads);
  if (m.num_kv_heads != m.num_heads)
    FORGE_FAIL("{}: \"num_key_value_heads\" is {}{}; Multi-head Latent Attention gives each of the {} heads "
               "(\"num_attention_heads\") keys and values of its own: expected {}",
               r.path(), m.num_kv_heads, kv_heads_given ? "" : " (DeepseekV3Config's default, the key being absent)",
               m.num_heads, m.num_heads);
  m.head_dim = 0;  // transformers sets head_dim to qk_rope_head_dim, for its rotary embedding
  m.q_lora_rank = r.config().contains("q_lora_rank") && r.config()["q_lora_rank"].is_null()
                      ? 0
                      : r.positive_int_or("q_lora_rank", 1536);
  m.kv_lora_rank = r.positive_int_or("kv_lora_rank", 512);
  m.qk_nope_head_dim = r.positive_int_or("qk_nope_head_dim", 128);
  m.qk_rope_head_dim = r.positive_int_or("qk_rope_head_dim", 64);
  m.v_head_dim = r.positive_int_or("v_head_dim", 128);
  if (v3) {  // how the weights are stored (hf_weight_layout), checked with the rest
    r.boolean_or("rope_interleave", true);
    r.non_negative_int_or("num_nextn_predict_layers", 1);
  }
}

// DeepSeek's experts and routing (NOTE [DeepSeek config keys] in hf_config.h).
void read_deepseek_experts(const HfConfigReader& r, ModelConfig& m, bool v3) {
  if (r.has("moe_layer_freq") && r.config()["moe_layer_freq"] != 1)
    FORGE_FAIL("{}: \"moe_layer_freq\" is {}; transformers (and forge) make every block after the dense ones a "
               "Mixture-of-Experts block, DeepSeek's code only every moe_layer_freq-th: expected 1",
               r.path(), describe_json(r.config()["moe_layer_freq"]));
  const int64_t dense = r.non_negative_int_or("first_k_dense_replace", v3 ? 3 : 0);
  if (dense >= m.num_layers) return;  // every block dense: the routing keys are never read
  m.first_dense_layers = dense;
  m.num_experts = r.positive_int_or("n_routed_experts", v3 ? 256 : 64);
  if (!v3 && !r.has("num_experts_per_tok"))
    FORGE_FAIL("{}: \"num_experts_per_tok\" is missing (expected a positive integer; DeepseekV2Config has no "
               "default)",
               r.path());
  m.num_experts_per_tok = r.positive_int_or("num_experts_per_tok", 8);
  m.moe_ffn_hidden_size = r.positive_int_or("moe_intermediate_size", v3 ? 2048 : 1407);
  m.num_shared_experts = r.non_negative_int_or("n_shared_experts", v3 ? 1 : 2);
  m.router_aux_loss_coef = 0.0;  // neither class computes a balancing loss
  const double scaling = r.positive_number_or("routed_scaling_factor", v3 ? 2.5 : 1.0);
  if (v3) {
    r.expect_string("scoring_func", "sigmoid", "DeepseekV3ForCausalLM routes on sigmoid scores");
    r.expect_string("topk_method", "noaux_tc",
                    "DeepseekV3ForCausalLM chooses on the scores plus e_score_correction_bias, group-limited");
    m.router_score_function = "sigmoid";
    m.router_normalize_topk = r.boolean_or("norm_topk_prob", true);
    m.router_scaling_factor = scaling;
    m.router_num_groups = r.positive_int_or("n_group", 8);
    m.router_topk_groups = r.positive_int_or("topk_group", 4);
    return;
  }
  r.expect_string("scoring_func", "softmax", "DeepseekV2ForCausalLM routes on softmax scores");
  const std::string method = r.string_or(r.config(), "topk_method", "greedy", "");
  if (method == "group_limited_greedy") {  // the 236B models: groups ranked by their best probability
    for (const char* key : {"n_group", "topk_group"})
      if (!r.has(key) || !r.config()[key].is_number_integer())
        FORGE_FAIL("{}: \"{}\" is {} with topk_method \"group_limited_greedy\": expected a positive integer", r.path(),
                   key, r.has(key) ? describe_json(r.config()[key]) : std::string("missing or null"));
    m.router_num_groups = r.positive_int_or("n_group", 1);
    m.router_topk_groups = r.positive_int_or("topk_group", 1);
  } else if (method == "greedy") {
    for (const char* key : {"n_group", "topk_group"})
      if (r.has(key) && !r.config()[key].is_null() && r.config()[key] != 1)
        FORGE_FAIL("{}: \"{}\" is {} with topk_method \"greedy\", which does not limit the experts to groups: "
                   "expected 1 or null",
                   r.path(), key, describe_json(r.config()[key]));
  } else {
    FORGE_FAIL("{}: \"topk_method\" is '{}'; DeepseekV2ForCausalLM routes \"greedy\" or \"group_limited_greedy\"",
               r.path(), method);
  }
  if (r.boolean_or("norm_topk_prob", false) && m.num_experts_per_tok > 1)
    FORGE_FAIL("{}: \"norm_topk_prob\" is true; DeepseekV2ForCausalLM never renormalizes the top-k weights, where "
               "DeepSeek's own code would: expected false",
               r.path());
  m.router_scaling_factor = scaling;
  m.router_score_function = "softmax";
  m.router_normalize_topk = false;
}

// YaRN (DeepSeek's rope_type "yarn"), as transformers' _compute_yarn_parameters reads it
// (NOTE [DeepSeek config keys] in hf_config.h).
void read_yarn(const HfConfigReader& r, const json& rope, const std::string& prefix, ModelConfig& m) {
  RopeScaling& y = m.rope_scaling;
  y.enabled = true;
  y.type = "yarn";
  if (!rope.contains("factor") || rope["factor"].is_null())
    FORGE_FAIL("{}: \"{}factor\" is missing (required by rope_type yarn)", r.path(), prefix);
  y.factor = r.positive_number_or(rope, "factor", 0, prefix);
  if (y.factor < 1.0)
    FORGE_FAIL("{}: \"{}factor\" is {}; YaRN extends the context: expected a factor >= 1", r.path(), prefix, y.factor);
  // A top-level original_max_position_embeddings wins, as transformers' standardize_rope_params has it.
  const json& c = r.config();
  const json& original = r.has("original_max_position_embeddings") ? c["original_max_position_embeddings"]
                         : rope.contains("original_max_position_embeddings") &&
                                 !rope["original_max_position_embeddings"].is_null()
                             ? rope["original_max_position_embeddings"]
                             : json(m.max_seq_len);
  if (!original.is_number_integer() || original.get<int64_t>() < 1)
    FORGE_FAIL("{}: \"{}original_max_position_embeddings\" is {}, expected a positive integer", r.path(),
               r.has("original_max_position_embeddings") ? "" : prefix, describe_json(original));
  y.original_max_position = original.get<int64_t>();
  // transformers takes `beta_fast or 32`, `beta_slow or 1`: 0 and null mean the default.
  auto number_or_zero = [&](const char* key) {
    if (!rope.contains(key) || rope[key].is_null()) return 0.0;
    if (!rope[key].is_number() || rope[key].get<double>() < 0)
      FORGE_FAIL("{}: \"{}{}\" is {}, expected a number >= 0", r.path(), prefix, key, describe_json(rope[key]));
    return rope[key].get<double>();
  };
  y.beta_fast = number_or_zero("beta_fast") != 0 ? number_or_zero("beta_fast") : 32.0;
  y.beta_slow = number_or_zero("beta_slow") != 0 ? number_or_zero("beta_slow") : 1.0;
  if (!(y.beta_fast > y.beta_slow))
    FORGE_FAIL("{}: \"{}beta_fast\" ({}) must be greater than \"{}beta_slow\" ({})", r.path(), prefix, y.beta_fast,
               prefix, y.beta_slow);
  y.mscale = number_or_zero("mscale");
  y.mscale_all_dim = number_or_zero("mscale_all_dim");
  if (rope.contains("attention_factor") && !rope["attention_factor"].is_null()) {
    const json& given = rope["attention_factor"];
    const double forge = rope_attention_factor(y);
    if (!given.is_number() || std::abs(given.get<double>() - forge) > 1e-12 * forge)
      FORGE_FAIL("{}: \"{}attention_factor\" is {}; forge scales cos/sin by the factor YaRN derives from factor, "
                 "mscale and mscale_all_dim, {:.17g}: expected that or no attention_factor",
                 r.path(), prefix, describe_json(given), forge);
  }
  if (rope.contains("truncate") && !rope["truncate"].is_null()) {
    const json& truncate = rope["truncate"];
    if (!truncate.is_boolean())
      FORGE_FAIL("{}: \"{}truncate\" is {}, expected true or false", r.path(), prefix, describe_json(truncate));
    const YarnRamp rounded = yarn_ramp(m.qk_rope_head_dim, m.rope_theta, y),
                   exact = yarn_ramp(m.qk_rope_head_dim, m.rope_theta, y, false);
    if (!truncate.get<bool>() && !(rounded == exact))
      FORGE_FAIL("{}: \"{}truncate\" is false: YaRN's ramp would run from dimension {:.6g} to {:.6g} unrounded, "
                 "where forge rounds it to {} to {}: expected true",
                 r.path(), prefix, exact.low, exact.high, rounded.low, rounded.high);
  }
}

// RoPE, as transformers resolves it: legacy rope_scaling wins over rope_parameters;
// rope_theta from inside the dict, else the top level, else the family's default_theta.
// DeepSeek's (yarn_allowed) may be YaRN instead of Llama 3.1's scaling.
void read_rope(const HfConfigReader& r, ModelConfig& m, double default_theta, bool yarn_allowed) {
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
  if (yarn_allowed) {
    if (type != "yarn")
      FORGE_FAIL("{}: \"{}rope_type\" is '{}'; forge supports \"default\" and \"yarn\" for DeepSeek models", r.path(),
                 prefix, type);
    return read_yarn(r, rope, prefix, m);
  }
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

  const bool mixtral = family == "mixtral", deepseek = is_deepseek(family), v3 = family == "deepseek_v3";
  if (deepseek && r.has("quantization_config"))
    FORGE_FAIL("{}: \"quantization_config\" is set (a quantized checkpoint, such as DeepSeek-V3's FP8 weights); "
               "forge reads unquantized F32, BF16, F16 or F64 weights: dequantize them first",
               path);
  ModelConfig m;
  m.vocab_size = r.positive_int("vocab_size");
  m.hidden_size = r.positive_int("hidden_size");
  m.ffn_hidden_size = deepseek ? r.positive_int_or("intermediate_size", v3 ? 18432 : 11008)
                               : r.positive_int("intermediate_size");
  m.num_layers = r.positive_int("num_hidden_layers");
  m.num_heads = r.positive_int("num_attention_heads");
  if (deepseek) {
    read_latent_attention(r, m, v3);
  } else {
    m.num_kv_heads = r.positive_int_or("num_key_value_heads", mixtral ? 8 : m.num_heads);
    const int64_t head_dim = r.positive_int_or("head_dim", m.hidden_size / m.num_heads);
    m.head_dim = checked_mul(head_dim, m.num_heads) == m.hidden_size ? 0 : head_dim;
  }
  m.norm_eps = r.positive_number_or(config, "rms_norm_eps", mixtral ? 1e-5 : 1e-6, "");
  m.max_seq_len = r.positive_int_or("max_position_embeddings", family == "llama" || family == "deepseek_v2" ? 2048
                                                               : v3                                          ? 4096
                                                                                                             : 4096 * 32);
  m.tie_word_embeddings = r.boolean_or("tie_word_embeddings", false);
  if (family == "mistral") {
    // MistralConfig defaults sliding_window to 4096 when the key is absent; null means none.
    m.sliding_window = config.contains("sliding_window") ? r.positive_int_or("sliding_window", 0) : 4096;
  } else if (mixtral) {
    m.sliding_window = r.positive_int_or("sliding_window", 0);  // MixtralConfig's default: none
  }
  if (mixtral) read_experts(r, m);
  if (deepseek) read_deepseek_experts(r, m, v3);
  read_rope(r, m, mixtral ? 1e6 : 10000.0, deepseek);
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

HfWeightLayout hf_weight_layout(const json& config, const std::string& path) {
  HfWeightLayout layout;
  if (hf_model_family(config, path) != "deepseek_v3") return layout;
  const HfConfigReader r(config, path);
  layout.interleaved_rotary = r.boolean_or("rope_interleave", true);
  layout.extra_layers = r.non_negative_int_or("num_nextn_predict_layers", 1);
  return layout;
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

namespace {

// The RoPE dicts, transformers 5's rope_parameters and the legacy rope_scaling (null when
// unscaled; with "type" too for YaRN, the name DeepSeek's own code reads).
std::pair<nlohmann::ordered_json, nlohmann::ordered_json> rope_dicts(const RopeScaling& s, double theta) {
  const char* type = !s.enabled ? "default" : s.yarn() ? "yarn" : "llama3";
  nlohmann::ordered_json rope = {{"rope_theta", theta}, {"rope_type", type}};
  if (s.yarn()) {
    rope["factor"] = s.factor;
    rope["original_max_position_embeddings"] = s.original_max_position;
    rope["beta_fast"] = s.beta_fast;
    rope["beta_slow"] = s.beta_slow;
    if (s.mscale != 0.0) rope["mscale"] = s.mscale;
    if (s.mscale_all_dim != 0.0) rope["mscale_all_dim"] = s.mscale_all_dim;
  } else if (s.enabled) {
    rope["factor"] = s.factor;
    rope["low_freq_factor"] = s.low_freq_factor;
    rope["high_freq_factor"] = s.high_freq_factor;
    rope["original_max_position_embeddings"] = s.original_max_position;
  }
  nlohmann::ordered_json legacy = rope;
  legacy.erase("rope_theta");
  if (s.yarn()) legacy["type"] = "yarn";
  return {rope, s.enabled ? legacy : nlohmann::ordered_json(nullptr)};
}

// What keeps a model without MLA from being written as Llama, Mistral or Mixtral (NOTE
// [Mixtral config keys]); empty when nothing does.
std::string not_writable_without_mla(const ModelConfig& m) {
  if (m.rope_scaling.yarn()) return "YaRN RoPE (model.rope_scaling.type yarn) is DeepSeek's, with Multi-head Latent Attention";
  if (!m.moe()) return "";
  if (m.num_shared_experts > 0) return fmt::format("model.num_shared_experts is {}", m.num_shared_experts);
  if (m.first_dense_layers > 0) return fmt::format("model.first_dense_layers is {}", m.first_dense_layers);
  if (m.router_score_function != "softmax")
    return fmt::format("model.router_score_function is {}", m.router_score_function);
  if (!m.router_normalize_topk) return "model.router_normalize_topk is false";
  if (m.router_scaling_factor != 1.0) return fmt::format("model.router_scaling_factor is {}", m.router_scaling_factor);
  if (m.router_num_groups != 1) return fmt::format("model.router_num_groups is {}", m.router_num_groups);
  if (m.moe_ffn_hidden_size != 0 && m.moe_ffn_hidden_size != m.ffn_hidden_size)
    return fmt::format("model.moe_ffn_hidden_size is {}, not model.ffn_hidden_size ({})", m.moe_ffn_hidden_size,
                       m.ffn_hidden_size);
  return "";
}

// NOTE [DeepSeek config keys] in hf_config.h.
nlohmann::ordered_json deepseek_config_from_model(const ModelConfig& m, const std::string& dtype, std::string family,
                                                  const HfWeightLayout& layout) {
  const bool sigmoid = m.moe() && m.router_score_function == "sigmoid";
  if (family.empty()) family = sigmoid ? "deepseek_v3" : "deepseek_v2";
  const bool v3 = family == "deepseek_v3";
  FORGE_CHECK(!m.moe() || sigmoid == v3, "a model routing on {} scores cannot be written as a {} model",
              m.router_score_function, family);
  FORGE_CHECK(v3 || layout.interleaved_rotary, "DeepseekV2ForCausalLM's rotary rows are always interleaved");
  auto refuse = [&](const std::string& why) {
    FORGE_FAIL("cannot write the model as Hugging Face {}: {}", v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM",
               why);
  };
  if (m.rope_scaling.enabled && !m.rope_scaling.yarn())
    refuse("forge writes DeepSeek models with default or YaRN RoPE, not model.rope_scaling.type llama3");
  if (m.moe() && !v3 && m.router_normalize_topk && m.num_experts_per_tok > 1)
    refuse("its softmax routing renormalizes the top-k weights (model.router_normalize_topk true), which "
           "DeepseekV2ForCausalLM never does");
  auto [rope, legacy_scaling] = rope_dicts(m.rope_scaling, m.rope_theta);
  nlohmann::ordered_json c;
  c["architectures"] = {v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"};
  c["model_type"] = family;
  c["vocab_size"] = m.vocab_size;
  c["hidden_size"] = m.hidden_size;
  c["intermediate_size"] = m.ffn_hidden_size;
  c["num_hidden_layers"] = m.num_layers;
  c["num_attention_heads"] = m.num_heads;
  c["num_key_value_heads"] = m.num_heads;
  c["q_lora_rank"] = m.q_lora_rank > 0 ? nlohmann::ordered_json(m.q_lora_rank) : nlohmann::ordered_json(nullptr);
  c["kv_lora_rank"] = m.kv_lora_rank;
  c["qk_nope_head_dim"] = m.qk_nope_head_dim;
  c["qk_rope_head_dim"] = m.qk_rope_head_dim;
  c["v_head_dim"] = m.v_head_dim;
  c["qk_head_dim"] = m.qk_head_dim();  // what transformers derives and writes
  c["head_dim"] = m.qk_rope_head_dim;
  c["hidden_act"] = "silu";
  c["rms_norm_eps"] = m.norm_eps;
  c["max_position_embeddings"] = m.max_seq_len;
  c["rope_parameters"] = rope;
  c["rope_theta"] = m.rope_theta;
  c["rope_scaling"] = legacy_scaling;
  if (v3) c["rope_interleave"] = layout.interleaved_rotary;
  c["first_k_dense_replace"] = m.moe() ? m.first_dense_layers : m.num_layers;  // a dense model: every block
  if (m.moe()) {
    c["n_routed_experts"] = m.num_experts;
    c["num_experts_per_tok"] = m.num_experts_per_tok;
    c["moe_intermediate_size"] = m.resolved_moe_ffn();
    c["n_shared_experts"] = m.num_shared_experts;
    c["norm_topk_prob"] = v3 && m.router_normalize_topk;
    c["routed_scaling_factor"] = m.router_scaling_factor;
    c["n_group"] = m.router_num_groups;
    c["topk_group"] = m.router_topk_groups;
    // V3's: DeepSeek's own name, which transformers does not read; V2's limits the groups or not.
    c["topk_method"] = v3 ? "noaux_tc" : m.router_topk_groups < m.router_num_groups ? "group_limited_greedy" : "greedy";
    c["scoring_func"] = v3 ? "sigmoid" : "softmax";
    c["moe_layer_freq"] = 1;
  }
  c["output_router_logits"] = false;
  if (v3) c["num_nextn_predict_layers"] = 0;  // no multi-token-prediction blocks are written
  c["attention_bias"] = false;
  if (!v3) c["mlp_bias"] = false;
  c["attention_dropout"] = 0.0;
  c["tie_word_embeddings"] = m.tie_word_embeddings;
  c["initializer_range"] = m.init_std;
  c["use_cache"] = true;
  c["dtype"] = dtype;
  c["torch_dtype"] = dtype;  // the name transformers 4.x reads
  return c;
}

}  // namespace

nlohmann::ordered_json hf_config_from_model(const ModelConfig& m, const std::string& dtype, const std::string& family,
                                            const HfWeightLayout& layout) {
  FORGE_CHECK(family.empty() || family == "llama" || family == "mistral" || family == "mixtral" || is_deepseek(family),
              "unknown model family '{}'", family);
  FORGE_CHECK(family.empty() || m.mla() == is_deepseek(family), "a model {} Multi-head Latent Attention cannot be "
              "written as a {} model", m.mla() ? "with" : "without", family);
  if (m.mla()) return deepseek_config_from_model(m, dtype, family, layout);
  if (const std::string why = not_writable_without_mla(m); !why.empty())
    FORGE_FAIL("cannot write the model as Hugging Face: {}; forge writes Llama, Mistral and Mixtral models (plain "
               "softmax top-k routing, renormalized) and, with Multi-head Latent Attention (model.kv_lora_rank > 0), "
               "DeepSeek-V2/V3 models",
               why);
  FORGE_CHECK(family != "llama" || m.sliding_window == 0, "a Llama model has no sliding window");
  FORGE_CHECK(family.empty() || m.moe() == (family == "mixtral"), "a {} model cannot be written as a {} model",
              m.moe() ? "Mixture-of-Experts" : "dense", family);
  // A MoE model is always Mixtral (with or without a sliding window).
  const bool mixtral = m.moe();
  const bool mistral = !mixtral && (family.empty() ? m.sliding_window > 0 : family == "mistral");
  const char* architecture = mixtral ? "MixtralForCausalLM" : mistral ? "MistralForCausalLM" : "LlamaForCausalLM";
  auto [rope, legacy_scaling] = rope_dicts(m.rope_scaling, m.rope_theta);
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
  c["rope_scaling"] = legacy_scaling;
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
