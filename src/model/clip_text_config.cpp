// CLIP text encoder configs; see clip_text_config.h.
#include "model/clip_text_config.h"

#include "core/checked_math.h"
#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace {

using nlohmann::json;

// config.json's keys, each error naming the file and the key.
class KeyReader {
 public:
  KeyReader(const json& config, const std::string& path) : config_(config), path_(path) {}

  bool has(const char* key) const { return config_.contains(key); }
  int64_t positive_int_or(const char* key, int64_t fallback) const {
    if (!has(key)) return fallback;
    const json& v = config_[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 1)
      FORGE_FAIL("{}: \"{}\" is {}, expected a positive integer", path_, key, describe_json(v));
    return v.get<int64_t>();
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
    if (!v.is_number() || !(v.get<double>() >= 0.0))
      FORGE_FAIL("{}: \"{}\" is {}, expected a number >= 0", path_, key, describe_json(v));
    return v.get<double>();
  }
  std::string string_or(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    const json& v = config_[key];
    if (!v.is_string()) FORGE_FAIL("{}: \"{}\" is {}, expected a string", path_, key, describe_json(v));
    return v.get<std::string>();
  }

 private:
  const json& config_;
  const std::string& path_;
};

ClipActivation activation_from_name(const std::string& name, const std::string& path) {
  if (name == "quick_gelu") return ClipActivation::QuickGelu;
  if (name == "gelu") return ClipActivation::GeluErf;
  if (name == "gelu_new" || name == "gelu_pytorch_tanh") return ClipActivation::GeluTanh;
  FORGE_FAIL("{}: \"hidden_act\" is '{}'; forge's CLIP text encoder runs quick_gelu, gelu, gelu_new and "
             "gelu_pytorch_tanh",
             path, name);
}

}  // namespace

// Per layer: q, k, v, out (d x d + d each), fc1 (m x d + m), fc2 (d x m + d), two norms
// (2 d each); then both embeddings and the final norm.
std::optional<int64_t> ClipTextConfig::checked_total_params() const {
  const int64_t d = hidden_size, m = intermediate_size;
  const std::optional<int64_t> dd = checked_mul(d, d), dm = checked_mul(d, m);
  std::optional<int64_t> layer = checked_mul(checked_add(dd, d), 4);
  layer = checked_add(layer, checked_mul(dm, 2));
  layer = checked_add(layer, checked_add(m, checked_mul(d, 5)));
  std::optional<int64_t> total = checked_add(checked_mul(vocab_size, d), checked_mul(max_positions, d));
  total = checked_add(total, checked_mul(layer, num_layers));
  return checked_add(total, checked_mul(d, 2));
}

int64_t ClipTextConfig::total_params() const {
  const std::optional<int64_t> total = checked_total_params();
  FORGE_CHECK(total.has_value(), "CLIP text encoder {}: the parameter count overflows 64-bit integers", name);
  return *total;
}

void ClipTextConfig::validate(std::string_view source) const {
  auto positive = [&](int64_t v, const char* key) {
    FORGE_CHECK(v > 0, "{}: {} must be positive, got {}", source, key, v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden_size");
  positive(intermediate_size, "intermediate_size");
  positive(num_layers, "num_hidden_layers");
  positive(num_heads, "num_attention_heads");
  positive(max_positions, "max_position_embeddings");
  FORGE_CHECK(hidden_size % num_heads == 0, "{}: hidden_size {} must be a multiple of num_attention_heads {}", source,
              hidden_size, num_heads);
  FORGE_CHECK(layer_norm_eps >= 0.0, "{}: layer_norm_eps must be >= 0, got {}", source, layer_norm_eps);
  FORGE_CHECK(eos_token_id >= 0 && eos_token_id < vocab_size,
              "{}: eos_token_id {} must be a token id of the vocabulary [0, {})", source, eos_token_id, vocab_size);
  FORGE_CHECK(checked_total_params().has_value(),
              "{}: the parameter count of vocab_size {}, hidden_size {}, intermediate_size {} and {} layers "
              "overflows 64-bit integers",
              source, vocab_size, hidden_size, intermediate_size, num_layers);
}

ClipTextConfig clip_l_text_config() {
  ClipTextConfig c;
  c.name = "clip-vit-large-patch14";
  return c;
}

ClipTextConfig clip_text_config_from_json(const json& config, const std::string& path) {
  if (!config.is_object()) FORGE_FAIL("{}: expected a JSON object, got {}", path, describe_json(config));
  const KeyReader r(config, path);
  if (r.has("architectures")) {
    const json& archs = config["architectures"];
    if (!archs.is_array() || archs.size() != 1 || !archs[0].is_string())
      FORGE_FAIL("{}: \"architectures\" is {}, expected a list with one name", path, describe_json(archs));
    const std::string arch = archs[0].get<std::string>();
    if (arch != "CLIPTextModel")
      FORGE_FAIL("{}: \"architectures\" is [\"{}\"]; forge's CLIP text encoder is a CLIPTextModel (FLUX.1's "
                 "text_encoder/), without a projection or a vision tower",
                 path, arch);
  }
  const std::string model_type = r.string_or("model_type", "clip_text_model");
  if (model_type != "clip_text_model")
    FORGE_FAIL("{}: \"model_type\" is '{}'; forge's CLIP text encoder reads a \"clip_text_model\" config", path,
               model_type);
  ClipTextConfig c;
  c.name = path;
  c.vocab_size = r.positive_int_or("vocab_size", 49408);
  c.hidden_size = r.positive_int_or("hidden_size", 512);
  c.intermediate_size = r.positive_int_or("intermediate_size", 2048);
  c.num_layers = r.positive_int_or("num_hidden_layers", 12);
  c.num_heads = r.positive_int_or("num_attention_heads", 8);
  c.max_positions = r.positive_int_or("max_position_embeddings", 77);
  c.activation = activation_from_name(r.string_or("hidden_act", "quick_gelu"), path);
  c.layer_norm_eps = r.non_negative_number_or("layer_norm_eps", 1e-5);
  c.eos_token_id = r.non_negative_int_or("eos_token_id", 49407);
  c.validate(path);
  return c;
}

ClipTextConfig read_clip_text_config(const std::string& path) {
  return clip_text_config_from_json(read_json_file(path, "the CLIP text encoder's config.json"), path);
}

std::string_view clip_activation_name(ClipActivation activation) {
  switch (activation) {
    case ClipActivation::QuickGelu: return "quick_gelu";
    case ClipActivation::GeluErf: return "gelu";
    case ClipActivation::GeluTanh: return "gelu_pytorch_tanh";
  }
  return "?";
}

}  // namespace forge
