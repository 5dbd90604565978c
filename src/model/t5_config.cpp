#include "model/t5_config.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace {

using nlohmann::json;

// Typed access to config.json keys, transformers' default where a key is absent
// or null; every error names the file and the key.
class Reader {
 public:
  Reader(const json& j, const std::string& path) : j_(j), path_(path) {}

  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }
  int64_t positive_int(const char* key, int64_t fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 1)
      FORGE_FAIL("{}: \"{}\" is {}, expected a positive integer", path_, key, describe_json(v));
    return v.get<int64_t>();
  }
  double positive_number(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    const json& v = j_[key];
    if (!v.is_number() || !(v.get<double>() > 0))
      FORGE_FAIL("{}: \"{}\" is {}, expected a positive number", path_, key, describe_json(v));
    return v.get<double>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_string()) FORGE_FAIL("{}: \"{}\" is {}, expected a string", path_, key, describe_json(j_[key]));
    return j_[key].get<std::string>();
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_boolean())
      FORGE_FAIL("{}: \"{}\" is {}, expected true or false", path_, key, describe_json(j_[key]));
    return j_[key].get<bool>();
  }

 private:
  const json& j_;
  const std::string& path_;
};

}  // namespace

void T5Config::validate(std::string_view source) const {
  auto positive = [&](int64_t v, const char* key) {
    FORGE_CHECK(v > 0, "{}: {} must be positive, got {}", source, key, v);
  };
  positive(vocab_size, "vocab_size");
  positive(d_model, "d_model");
  positive(d_kv, "d_kv");
  positive(num_heads, "num_heads");
  positive(d_ff, "d_ff");
  positive(num_layers, "num_layers");
  // The bidirectional bucket function (t5_relative_position_bucket) gives each
  // direction buckets / 2, half of them exact: it needs at least one exact
  // bucket and a max_distance beyond them (log(max_distance / exact) divides).
  FORGE_CHECK(relative_attention_num_buckets >= 4,
              "{}: relative_attention_num_buckets must be at least 4 (each "
              "direction's half needs an exact bucket), "
              "got {}",
              source, relative_attention_num_buckets);
  const int64_t exact = relative_attention_num_buckets / 4;
  FORGE_CHECK(relative_attention_max_distance > exact,
              "{}: relative_attention_max_distance must exceed the {} exact "
              "buckets of each direction "
              "(relative_attention_num_buckets / 4), got {}",
              source, exact, relative_attention_max_distance);
  FORGE_CHECK(layer_norm_epsilon > 0, "{}: layer_norm_epsilon must be positive, got {}", source, layer_norm_epsilon);
}

int64_t T5Config::parameter_count() const {
  const int64_t block = 2 * d_model + 4 * d_model * inner_dim() + 3 * d_model * d_ff;
  return vocab_size * d_model + relative_attention_num_buckets * num_heads + num_layers * block + d_model;
}

T5Config t5_v1_1_xxl_config() {
  T5Config c;
  c.name = "t5-v1_1-xxl";
  return c;
}

T5Config read_t5_config(const std::string& path) {
  const json j = read_json_file(path, "the T5 encoder's config.json");
  FORGE_CHECK(j.is_object(), "{}: expected a JSON object, got {}", path, describe_json(j));
  const Reader r(j, path);
  const std::string model_type = r.string("model_type", "t5");
  if (model_type != "t5")
    FORGE_FAIL(
        "{}: \"model_type\" is \"{}\"; forge's T5 encoder reads \"t5\" "
        "(T5 v1.1, as FLUX.1's text_encoder_2)",
        path, model_type);
  T5Config c;
  c.name = path;
  c.vocab_size = r.positive_int("vocab_size", 32128);
  c.d_model = r.positive_int("d_model", 512);
  c.d_kv = r.positive_int("d_kv", 64);
  c.d_ff = r.positive_int("d_ff", 2048);
  c.num_layers = r.positive_int("num_layers", 6);
  c.num_heads = r.positive_int("num_heads", 8);
  c.relative_attention_num_buckets = r.positive_int("relative_attention_num_buckets", 32);
  c.relative_attention_max_distance = r.positive_int("relative_attention_max_distance", 128);
  c.layer_norm_epsilon = r.positive_number("layer_norm_epsilon", 1e-6);

  // transformers derives the activation from feed_forward_proj, and a config's
  // own is_gated_act / dense_act_fn then override what it derived.
  const std::string proj = r.string("feed_forward_proj", "relu");
  if (proj != "gated-gelu")
    FORGE_FAIL(
        "{}: \"feed_forward_proj\" is \"{}\"; forge's T5 encoder computes T5 "
        "v1.1's \"gated-gelu\" only "
        "(the original T5's \"relu\" and other activations are not built)",
        path, proj);
  if (!r.boolean("is_gated_act", true))
    FORGE_FAIL(
        "{}: \"is_gated_act\" is false; forge's T5 encoder computes the "
        "gated feed-forward (wi_0, wi_1, wo) only",
        path);
  const std::string act = r.string("dense_act_fn", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    FORGE_FAIL(
        "{}: \"dense_act_fn\" is \"{}\"; forge's T5 encoder computes "
        "GELU's tanh approximation "
        "(\"gelu_new\" or \"gelu_pytorch_tanh\") only",
        path, act);
  c.validate(path);
  return c;
}

}  // namespace forge
