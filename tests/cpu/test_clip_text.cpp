// CLIP's text encoder: its config (the CLIP-L preset, transformers' config.json and its
// refusals), the pooling rule, the weight files (every layout forge reads, and every tensor
// that is missing, misshapen, of the wrong dtype or has no place), and the encoder's causal
// forward. The numbers against transformers are python.test_clip_text_vs_transformers's.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/clip_text_weights.h"
#include "ckpt/safetensors.h"
#include "core/rng.h"
#include "expect_error.h"
#include "file_testing.h"
#include "model/clip_text_encoder.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::write_file;

// A tiny config: 2 layers of 16 (2 heads of 8), MLP 24, 40 tokens, 8 positions.
json tiny_config_json() {
  return {{"architectures", {"CLIPTextModel"}},
          {"model_type", "clip_text_model"},
          {"vocab_size", 40},
          {"hidden_size", 16},
          {"intermediate_size", 24},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 2},
          {"max_position_embeddings", 8},
          {"hidden_act", "quick_gelu"},
          {"layer_norm_eps", 1e-5},
          {"eos_token_id", 2},
          {"projection_dim", 768},
          {"torch_dtype", "bfloat16"}};
}

ClipTextConfig tiny_config() { return clip_text_config_from_json(tiny_config_json(), "tiny"); }

void fill_random(ClipTextParameters& params, uint64_t seed) {
  Rng rng(seed);
  for (const Tensor& t : params.tensors())
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(0.3 * rng.normal());
}

// Writes the parameters as a folder: config.json and model.safetensors, names with `prefix`.
void write_folder(const std::string& dir, const ClipTextParameters& params, const json& config,
                  const std::string& prefix = "", SafetensorsDType stored = SafetensorsDType::F32) {
  fs::create_directories(dir);
  write_file(dir + "/config.json", config.dump());
  std::vector<SafetensorsTensorRef> refs;
  for (size_t i = 0; i < params.specs().size(); ++i)
    refs.push_back({prefix + params.specs()[i].name, params.specs()[i].shape, params.tensors()[i].data<float>()});
  write_safetensors(dir + "/model.safetensors", refs, stored, {{"format", "pt"}});
}

// A safetensors file of raw tensors: (name, dtype name, shape, bytes).
struct RawTensor {
  std::string name, dtype;
  Shape shape;
  std::string bytes;
};
void write_raw_safetensors(const std::string& path, const std::vector<RawTensor>& tensors) {
  json header = json::object();
  std::string data;
  for (const RawTensor& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {data.size(), data.size() + t.bytes.size()}}};
    data += t.bytes;
  }
  std::string text = header.dump();
  while ((8 + text.size()) % 8) text += ' ';
  std::string file(8, '\0');
  const uint64_t n = text.size();
  std::memcpy(file.data(), &n, 8);
  write_file(path, file + text + data);
}

// Every parameter as F32 bytes, plus `extra`.
std::vector<RawTensor> raw_parameters(const ClipTextParameters& params, const std::string& prefix = "") {
  std::vector<RawTensor> out;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const Tensor& t = params.tensors()[i];
    out.push_back({prefix + params.specs()[i].name, "F32", params.specs()[i].shape,
                   std::string(static_cast<const char*>(t.raw()), t.nbytes())});
  }
  return out;
}

std::string int64_bytes(const std::vector<int64_t>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int64_t));
}

TEST(ClipTextConfig, ClipLPresetIsFluxsTextEncoder) {
  const ClipTextConfig c = clip_l_text_config();
  EXPECT_EQ(c.total_params(), 123'060'480);  // transformers' CLIPTextModel for openai/clip-vit-large-patch14
  EXPECT_EQ(c.head_dim(), 64);
  EXPECT_EQ(c.max_positions, 77);
  EXPECT_EQ(c.activation, ClipActivation::QuickGelu);
  EXPECT_TRUE(c.legacy_pooling());
}

TEST(ClipTextConfig, ReadsTransformersKeysAndDefaults) {
  const ClipTextConfig c = tiny_config();
  EXPECT_EQ(c.vocab_size, 40);
  EXPECT_EQ(c.hidden_size, 16);
  EXPECT_EQ(c.intermediate_size, 24);
  EXPECT_EQ(c.num_layers, 2);
  EXPECT_EQ(c.num_heads, 2);
  EXPECT_EQ(c.max_positions, 8);
  EXPECT_EQ(c.eos_token_id, 2);
  // An empty config is CLIPTextConfig's defaults.
  const ClipTextConfig d = clip_text_config_from_json(json::object(), "empty");
  EXPECT_EQ(d.hidden_size, 512);
  EXPECT_EQ(d.intermediate_size, 2048);
  EXPECT_EQ(d.num_heads, 8);
  EXPECT_EQ(d.num_layers, 12);
  EXPECT_EQ(d.vocab_size, 49408);
  EXPECT_EQ(d.eos_token_id, 49407);
  EXPECT_FALSE(d.legacy_pooling());
  EXPECT_EQ(clip_text_config_from_json({{"hidden_act", "gelu"}}, "x").activation, ClipActivation::GeluErf);
  EXPECT_EQ(clip_text_config_from_json({{"hidden_act", "gelu_new"}}, "x").activation, ClipActivation::GeluTanh);
  EXPECT_EQ(clip_text_config_from_json({{"hidden_act", "gelu_pytorch_tanh"}}, "x").activation,
            ClipActivation::GeluTanh);
}

TEST(ClipTextConfig, RefusesOtherArchitecturesAndBadKeys) {
  struct Case {
    const char* key;
    json value;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"architectures", {"CLIPTextModelWithProjection"}, {"\"architectures\"", "CLIPTextModelWithProjection"}},
      {"architectures", {"CLIPModel"}, {"\"architectures\"", "CLIPModel"}},
      {"architectures", "CLIPTextModel", {"\"architectures\"", "a list"}},
      {"model_type", "clip", {"\"model_type\"", "clip_text_model"}},
      {"vocab_size", 0, {"\"vocab_size\"", "positive integer"}},
      {"hidden_size", "16", {"\"hidden_size\"", "positive integer"}},
      {"intermediate_size", 2.5, {"\"intermediate_size\""}},
      {"num_hidden_layers", -1, {"\"num_hidden_layers\""}},
      {"num_attention_heads", 3, {"hidden_size 16", "num_attention_heads 3"}},
      {"max_position_embeddings", nullptr, {"\"max_position_embeddings\""}},
      {"hidden_act", "relu", {"\"hidden_act\"", "relu", "quick_gelu"}},
      {"hidden_act", 1, {"\"hidden_act\"", "a string"}},
      {"layer_norm_eps", -1e-5, {"\"layer_norm_eps\""}},
      {"layer_norm_eps", nullptr, {"\"layer_norm_eps\""}},
      {"eos_token_id", 40, {"eos_token_id 40", "[0, 40)"}},
      {"eos_token_id", {2, 3}, {"\"eos_token_id\"", "integer"}},
  };
  for (const Case& c : cases) {
    json j = tiny_config_json();
    j[c.key] = c.value;
    std::vector<std::string> fragments = c.fragments;
    fragments.push_back("dir/config.json");
    expect_error([&] { clip_text_config_from_json(j, "dir/config.json"); }, fragments);
  }
  expect_error([&] { clip_text_config_from_json(json::array(), "dir/config.json"); }, {"dir/config.json", "object"});
}

TEST(ClipTextPooling, FollowsTransformersRules) {
  ClipTextConfig legacy = tiny_config();  // eos_token_id 2: the largest id, the first of equals
  EXPECT_EQ(clip_pooled_positions(legacy, {38, 5, 39, 39, 39, 4, 39, 0}, 1, 8), std::vector<int64_t>({2}));
  EXPECT_EQ(clip_pooled_positions(legacy, {1, 2, 3, 4, 38, 3, 2, 1, 0, 0, 0, 0}, 3, 4),
            std::vector<int64_t>({3, 0, 0}));
  ClipTextConfig modern = tiny_config();
  modern.eos_token_id = 7;  // the first 7; none: 0
  EXPECT_EQ(clip_pooled_positions(modern, {38, 5, 7, 39, 7, 1, 1, 1, 38, 39, 3, 7}, 3, 4),
            std::vector<int64_t>({2, 0, 3}));
}

TEST(ClipTextWeights, LoadsEveryLayout) {
  TempDir dir;
  const ClipTextConfig c = tiny_config();
  ClipTextParameters params(c);
  fill_random(params, 5);
  auto expect_loaded = [&](const std::string& path, bool bf16) {
    const ClipTextConfig read = read_clip_text_encoder_config(path);
    EXPECT_EQ(read.hidden_size, 16) << path;
    ClipTextParameters loaded(read);
    load_clip_text_weights(path, loaded);
    for (size_t i = 0; i < params.tensors().size(); ++i) {
      const float* a = loaded.tensors()[i].data<float>();
      const float* b = params.tensors()[i].data<float>();
      for (int64_t j = 0; j < params.tensors()[i].numel(); ++j) {
        if (bf16)
          ASSERT_NEAR(a[j], b[j], std::abs(b[j]) / 128 + 1e-30) << path << " " << params.specs()[i].name;
        else
          ASSERT_EQ(a[j], b[j]) << path << " " << params.specs()[i].name;
      }
    }
  };
  write_folder(dir.file("v5"), params, tiny_config_json());
  expect_loaded(dir.file("v5"), false);
  write_folder(dir.file("pipeline/text_encoder"), params, tiny_config_json(), "text_model.", SafetensorsDType::BF16);
  expect_loaded(dir.file("pipeline"), true);
  // transformers 4's names with its position_ids buffer.
  fs::create_directories(dir.file("v4"));
  write_file(dir.file("v4/config.json"), tiny_config_json().dump());
  std::vector<RawTensor> raw = raw_parameters(params, "text_model.");
  raw.push_back({"text_model.embeddings.position_ids", "I64", {1, 8}, int64_bytes({0, 1, 2, 3, 4, 5, 6, 7})});
  write_raw_safetensors(dir.file("v4/model.safetensors"), raw);
  expect_loaded(dir.file("v4"), false);
  // A lone file without a config.json beside it is CLIP-L: its shapes are refused here.
  fs::create_directories(dir.file("lone"));
  fs::copy_file(dir.file("v5/model.safetensors"), dir.file("lone/text.safetensors"));
  EXPECT_EQ(read_clip_text_encoder_config(dir.file("lone/text.safetensors")).total_params(), 123'060'480);
  // With a config.json beside it, that config.
  write_file(dir.file("lone/config.json"), tiny_config_json().dump());
  expect_loaded(dir.file("lone/text.safetensors"), false);
}

TEST(ClipTextWeights, RefusesMissingMisshapenForeignAndMistypedTensors) {
  TempDir dir;
  const ClipTextConfig c = tiny_config();
  ClipTextParameters params(c);
  fill_random(params, 6);
  auto load = [&](const std::string& path) {
    ClipTextParameters loaded(c);
    load_clip_text_weights(path, loaded);
  };
  auto folder_with = [&](const std::string& name, const std::vector<RawTensor>& tensors) {
    fs::create_directories(dir.file(name));
    write_file(dir.file(name + "/config.json"), tiny_config_json().dump());
    write_raw_safetensors(dir.file(name + "/model.safetensors"), tensors);
    return dir.file(name);
  };
  std::vector<RawTensor> all = raw_parameters(params);

  std::vector<RawTensor> missing = all;
  missing.erase(missing.begin() + 5);
  expect_error([&] { load(folder_with("missing", missing)); },
               {"missing", "encoder.layers.0.self_attn.q_proj.bias", "needs"});

  std::vector<RawTensor> misshapen = all;
  misshapen[2].shape = {8, 32};  // q_proj.weight [16, 16] as [8, 32]
  expect_error([&] { load(folder_with("misshapen", misshapen)); },
               {"misshapen/model.safetensors", "encoder.layers.0.self_attn.q_proj.weight", "[8, 32]", "[16, 16]"});

  std::vector<RawTensor> foreign = all;
  foreign.push_back({"text_projection.weight", "F32", {4}, std::string(16, '\0')});
  expect_error([&] { load(folder_with("foreign", foreign)); },
               {"foreign/model.safetensors", "text_projection.weight", "no place"});

  std::vector<RawTensor> mistyped = all;
  mistyped[0].dtype = "I32";  // token_embedding, the same byte count
  expect_error([&] { load(folder_with("mistyped", mistyped)); },
               {"mistyped/model.safetensors", "embeddings.token_embedding.weight", "I32", "F32, BF16 or F16"});

  std::vector<RawTensor> mixed = raw_parameters(params, "text_model.");
  mixed[3].name = all[3].name;
  expect_error([&] { load(folder_with("mixed", mixed)); }, {"mixed/model.safetensors", all[3].name, "text_model."});

  std::vector<RawTensor> positions = all;
  positions.push_back({"embeddings.position_ids", "I64", {1, 8}, int64_bytes({0, 1, 2, 3, 4, 5, 7, 6})});
  expect_error([&] { load(folder_with("positions", positions)); }, {"embeddings.position_ids", "index 6"});

  // config.json of another model than the parameters'.
  json other = tiny_config_json();
  other["hidden_act"] = "gelu";
  fs::create_directories(dir.file("other"));
  write_folder(dir.file("other"), params, other);
  expect_error([&] { load(dir.file("other")); }, {"other/config.json", "\"hidden_act\"", "gelu"});

  // Folders without weights or without config.json, and paths that are nothing.
  fs::create_directories(dir.file("empty"));
  expect_error([&] { load(dir.file("empty")); }, {"empty", "model.safetensors", "text_encoder/"});
  fs::create_directories(dir.file("no_config"));
  fs::copy_file(dir.file("missing/model.safetensors"), dir.file("no_config/model.safetensors"));
  expect_error([&] { load(dir.file("no_config")); }, {"no_config", "config.json"});
  expect_error([&] { load(dir.file("nothing")); }, {"nothing", "not found"});
}

TEST(ClipTextEncoder, IsCausalPoolsByTheRuleAndKeepsCaptionsApart) {
  const ClipTextConfig c = tiny_config();
  ClipTextParameters params(c);
  fill_random(params, 7);
  const int64_t seq = 8, d = c.hidden_size;
  const std::vector<int32_t> a = {38, 5, 9, 39, 39, 39, 39, 39}, b = {38, 5, 9, 39, 1, 2, 3, 4};
  ClipTextEncoder pair(c, 2, seq, Device::CPU);
  Tensor last = Tensor::empty({2, seq, d}), pooled = Tensor::empty({2, d});
  std::vector<int32_t> both = a;
  both.insert(both.end(), b.begin(), b.end());
  pair.forward(both, params, last, pooled);
  // Rows up to the end token do not see what follows it; the pooled row is the end token's.
  for (int64_t t = 0; t <= 3; ++t)
    for (int64_t k = 0; k < d; ++k)
      EXPECT_EQ(last.data<float>()[t * d + k], last.data<float>()[(seq + t) * d + k]) << t;
  for (int64_t k = 0; k < d; ++k) {
    EXPECT_EQ(pooled.data<float>()[k], last.data<float>()[3 * d + k]);
    EXPECT_EQ(pooled.data<float>()[d + k], last.data<float>()[(seq + 3) * d + k]);
  }
  bool later_rows_differ = false;
  for (int64_t k = 0; k < d; ++k)
    later_rows_differ |= last.data<float>()[7 * d + k] != last.data<float>()[(seq + 7) * d + k];
  EXPECT_TRUE(later_rows_differ);
  // A caption alone gives what it gives in the batch.
  ClipTextEncoder one(c, 1, seq, Device::CPU);
  Tensor last1 = Tensor::empty({1, seq, d}), pooled1 = Tensor::empty({1, d});
  one.forward(b, params, last1, pooled1);
  for (int64_t i = 0; i < seq * d; ++i) EXPECT_EQ(last1.data<float>()[i], last.data<float>()[seq * d + i]);
}

TEST(ClipTextEncoder, RefusesBadTokensAndShapes) {
  const ClipTextConfig c = tiny_config();
  ClipTextParameters params(c);
  ClipTextEncoder encoder(c, 1, 4, Device::CPU);
  Tensor last = Tensor::empty({1, 4, 16}), pooled = Tensor::empty({1, 16});
  expect_error([&] { encoder.forward({1, 2, 40, 3}, params, last, pooled); },
               {"token id 40", "position 2", "[0, 40)"});
  expect_error([&] { encoder.forward({1, 2, 3}, params, last, pooled); }, {"3 token ids", "1 captions of 4"});
  expect_error([&] { encoder.forward({1, 2, 3, 4}, params, Tensor::empty({1, 4, 8}), pooled); }, {"last_hidden"});
  expect_error([&] { ClipTextEncoder(c, 1, 9, Device::CPU); }, {"9 tokens", "1 to 8"});
  expect_error([&] { ClipTextEncoder(c, 0, 4, Device::CPU); }, {"at least one caption"});
}

}  // namespace
}  // namespace forge
