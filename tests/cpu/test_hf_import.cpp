// Hugging Face import and export: config.json mapping as transformers reads it (defaults,
// legacy and transformers-5 RoPE keys, Mistral's sliding window, Mixtral's experts,
// DeepSeek-V2/V3's Multi-head Latent Attention, experts, routing and YaRN) and its errors,
// weights exported and imported back bit for bit (single file and sharded; Mixtral's and
// DeepSeek's per-expert tensors as slices of forge's stacks, and transformers 5's whole
// stacks; DeepSeek's interleaved rotary rows reordered, V3's routing bias kept in fp32, the
// empty shared experts transformers writes), and the checks on weight files: missing,
// misshapen and unexpected tensors, inconsistent shard indexes, and an export that refuses
// to overwrite.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "ckpt/half_float.h"
#include "ckpt/hf_config.h"
#include "ckpt/hf_export.h"
#include "ckpt/hf_import.h"
#include "ckpt/hf_layout.h"
#include "ckpt/safetensors.h"
#include "cli/config.h"
#include "core/error.h"
#include "test_data_temp_dir.h"
#include "expect_error.h"

namespace forge {
namespace {

using nlohmann::json;

json llama_json() {
  return json::parse(R"({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 40, "hidden_size": 16,
    "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05, "max_position_embeddings": 64, "hidden_act": "silu", "attention_bias": false,
    "mlp_bias": false, "tie_word_embeddings": false, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}
  })");
}

ModelConfig tiny_model(bool tied, int64_t window) {
  ModelConfig m = model_config_from_hf(llama_json(), "config.json");
  m.tie_word_embeddings = tied;
  m.sliding_window = window;
  return m;
}

void expect_error(const json& config, const std::string& expected) {
  std::string e = error_of([&] { model_config_from_hf(config, "/models/x/config.json"); });
  EXPECT_NE(e.find("/models/x/config.json"), std::string::npos) << e;
  EXPECT_NE(e.find(expected), std::string::npos) << e << " (expected: " << expected << ")";
}

TEST(HfImportConfig, MapsLlamaKeys) {
  ModelConfig m = model_config_from_hf(llama_json(), "config.json");
  EXPECT_EQ(m.vocab_size, 40);
  EXPECT_EQ(m.hidden_size, 16);
  EXPECT_EQ(m.ffn_hidden_size, 24);
  EXPECT_EQ(m.num_layers, 2);
  EXPECT_EQ(m.num_heads, 4);
  EXPECT_EQ(m.num_kv_heads, 2);
  EXPECT_EQ(m.head_dim, 0);
  EXPECT_EQ(m.resolved_head_dim(), 4);
  EXPECT_EQ(m.norm_eps, 1e-5);
  EXPECT_EQ(m.max_seq_len, 64);
  EXPECT_EQ(m.rope_theta, 500000.0);
  EXPECT_FALSE(m.rope_scaling.enabled);
  EXPECT_EQ(m.sliding_window, 0);
  EXPECT_FALSE(m.tie_word_embeddings);
}

TEST(HfImportConfig, AppliesTransformersDefaults) {
  json c = llama_json();
  for (const char* key : {"num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
                          "tie_word_embeddings", "hidden_act"})
    c.erase(key);
  c["head_dim"] = nullptr;
  ModelConfig m = model_config_from_hf(c, "config.json");
  EXPECT_EQ(m.num_kv_heads, 4);
  EXPECT_EQ(m.norm_eps, 1e-6);
  EXPECT_EQ(m.max_seq_len, 2048);
  EXPECT_EQ(m.rope_theta, 10000.0);
  EXPECT_EQ(m.resolved_head_dim(), 4);
}

TEST(HfImportConfig, ExplicitHeadDim) {
  json c = llama_json();
  c["head_dim"] = 6;
  EXPECT_EQ(model_config_from_hf(c, "config.json").head_dim, 6);
  c["head_dim"] = 4;
  EXPECT_EQ(model_config_from_hf(c, "config.json").head_dim, 0);
}

TEST(HfImportConfig, LegacyRopeScalingLlama3) {
  json c = llama_json();
  c.erase("rope_parameters");
  c["rope_theta"] = 250000.0;
  c["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 8192}};
  ModelConfig m = model_config_from_hf(c, "config.json");
  EXPECT_EQ(m.rope_theta, 250000.0);
  EXPECT_TRUE(m.rope_scaling.enabled);
  EXPECT_EQ(m.rope_scaling.factor, 8.0);
  EXPECT_EQ(m.rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(m.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(m.rope_scaling.original_max_position, 8192);
  c["rope_scaling"].erase("rope_type");
  c["rope_scaling"]["type"] = "llama3";
  c["rope_scaling"].erase("original_max_position_embeddings");
  m = model_config_from_hf(c, "config.json");
  EXPECT_TRUE(m.rope_scaling.enabled);
  EXPECT_EQ(m.rope_scaling.original_max_position, 64);  // max_position_embeddings, as transformers fills it in
}

TEST(HfImportConfig, Transformers5RopeParametersLlama3) {
  json c = llama_json();
  c["rope_parameters"] = {{"rope_type", "llama3"}, {"rope_theta", 500000.0}, {"factor", 32.0},
                          {"low_freq_factor", 1.0}, {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}};
  ModelConfig m = model_config_from_hf(c, "config.json");
  EXPECT_TRUE(m.rope_scaling.enabled);
  EXPECT_EQ(m.rope_scaling.factor, 32.0);
  EXPECT_EQ(m.rope_scaling.original_max_position, 16);
}

TEST(HfImportConfig, MistralSlidingWindow) {
  json c = llama_json();
  c["architectures"] = {"MistralForCausalLM"};
  c.erase("attention_bias");
  c.erase("mlp_bias");
  c["sliding_window"] = 8;
  EXPECT_EQ(model_config_from_hf(c, "config.json").sliding_window, 8);
  c["sliding_window"] = nullptr;
  EXPECT_EQ(model_config_from_hf(c, "config.json").sliding_window, 0);
  c.erase("sliding_window");
  EXPECT_EQ(model_config_from_hf(c, "config.json").sliding_window, 4096);
}

TEST(HfImportConfig, RejectsUnsupportedModelsNamingFileAndKey) {
  json c = llama_json();
  c["architectures"] = {"GemmaForCausalLM"};
  expect_error(c, "\"architectures\" is [\"GemmaForCausalLM\"]");
  c = llama_json();
  c["rope_parameters"]["rope_type"] = "yarn";
  expect_error(c, "\"rope_parameters.rope_type\" is 'yarn'");
  c = llama_json();
  c.erase("rope_parameters");
  c["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  expect_error(c, "\"rope_scaling.rope_type\" is 'linear'");
  c = llama_json();
  c["attention_bias"] = true;
  expect_error(c, "\"attention_bias\" is true");
  c = llama_json();
  c["mlp_bias"] = true;
  expect_error(c, "\"mlp_bias\" is true");
  c = llama_json();
  c["hidden_act"] = "gelu";
  expect_error(c, "\"hidden_act\" is 'gelu'");
  c = llama_json();
  c.erase("hidden_size");
  expect_error(c, "\"hidden_size\" is missing");
  c = llama_json();
  c["num_hidden_layers"] = "2";
  expect_error(c, "\"num_hidden_layers\" is \"2\", expected a positive integer");
  c = llama_json();
  c["rope_parameters"]["partial_rotary_factor"] = 0.5;
  expect_error(c, "partial_rotary_factor");
  c = llama_json();
  c["rope_parameters"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  expect_error(c, "\"rope_parameters.low_freq_factor\" is missing");
  c = llama_json();
  c["num_key_value_heads"] = 3;
  expect_error(c, "model.num_heads (4) must be divisible by model.num_kv_heads (3)");
}

TEST(HfImportConfig, ExportedConfigReadsBackAsTheSameArchitecture) {
  for (bool tied : {false, true})
    for (int64_t window : {0, 5}) {
      ModelConfig m = tiny_model(tied, window);
      m.head_dim = 6;
      m.rope_scaling.enabled = true;
      m.rope_scaling.factor = 4.0;
      json written = json::parse(hf_config_from_model(m, "float32").dump());
      EXPECT_EQ(written["architectures"][0], window ? "MistralForCausalLM" : "LlamaForCausalLM");
      ModelConfig back = model_config_from_hf(written, "config.json");
      EXPECT_TRUE(architecture_differences(m, back).empty()) << fmt::format("{}", fmt::join(architecture_differences(m, back), "; "));
    }
}

TEST(HfImportConfig, ArchitectureDifferencesNameTheKeys) {
  ModelConfig a = tiny_model(false, 0), b = tiny_model(true, 0);
  b.vocab_size = 50;
  auto diffs = architecture_differences(a, b);
  ASSERT_EQ(diffs.size(), 2u);
  EXPECT_EQ(diffs[0], "model.vocab_size: 40 here, 50 in config.json");
  EXPECT_EQ(diffs[1], "model.tie_word_embeddings: false here, true in config.json");
  EXPECT_NE(model_overrides_for(b).find("--model.vocab_size 50"), std::string::npos);
}

void fill_pattern(FlatParameters& p) {
  float* x = p.flat().data<float>();
  for (int64_t i = 0; i < p.flat().numel(); ++i) x[i] = 0.001f * static_cast<float>(i % 977) - 0.3f;
}

void expect_same_weights(const FlatParameters& a, const FlatParameters& b) {
  ASSERT_EQ(a.flat().numel(), b.flat().numel());
  EXPECT_EQ(0, std::memcmp(a.flat().raw(), b.flat().raw(), a.flat().nbytes()));
}

TEST(HfImportWeights, ExportImportRoundTripIsExact) {
  for (bool tied : {false, true})
    for (int64_t window : {0, 3}) {
      TempDir dir;
      FlatParameters params(tiny_model(tied, window));
      fill_pattern(params);
      save_hf_model(dir.file("out"), params);
      EXPECT_TRUE(std::filesystem::exists(dir.file("out/model.safetensors")));
      EXPECT_FALSE(std::filesystem::exists(dir.file("out/generation_config.json")));
      HfModel model = load_hf_model(dir.file("out"));
      EXPECT_TRUE(architecture_differences(params.config(), model.config).empty());
      EXPECT_EQ(model.config.name, "out");
      expect_same_weights(params, *model.params);
    }
}

TEST(HfImportWeights, ShardedExportImportRoundTrip) {
  TempDir dir;
  FlatParameters params(tiny_model(false, 0));
  fill_pattern(params);
  HfExportOptions options;
  options.max_shard_bytes = 2000;
  save_hf_model(dir.file("out"), params, options);
  EXPECT_FALSE(std::filesystem::exists(dir.file("out/model.safetensors")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("out/model.safetensors.index.json")));
  int shards = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.file("out")))
    shards += entry.path().filename().string().starts_with("model-0000");
  EXPECT_GT(shards, 2);
  HfModel model = load_hf_model(dir.file("out"));
  expect_same_weights(params, *model.params);
}

TEST(HfImportWeights, Bf16ExportRoundsEachWeight) {
  TempDir dir;
  FlatParameters params(tiny_model(false, 0));
  fill_pattern(params);
  HfExportOptions options;
  options.dtype = SafetensorsDType::BF16;
  save_hf_model(dir.file("out"), params, options);
  HfModel model = load_hf_model(dir.file("out"));
  const float* a = params.flat().data<float>();
  const float* b = model.params->flat().data<float>();
  for (int64_t i = 0; i < params.flat().numel(); ++i) ASSERT_NEAR(a[i], b[i], std::abs(a[i]) / 256 + 1e-30) << i;
  EXPECT_EQ(read_hf_config(dir.file("out")).vocab_size, 40);
}

// Rewrites out/model.safetensors with `edit` applied to the list of tensors.
void rewrite_weights(const std::string& dir, const std::function<void(std::vector<SafetensorsTensorRef>&)>& edit) {
  const std::string path = dir + "/model.safetensors";
  SafetensorsFile file(path);
  std::vector<std::vector<float>> storage;
  std::vector<SafetensorsTensorRef> refs;
  for (const auto& e : file.entries()) {
    storage.emplace_back(static_cast<size_t>(e.numel()));
    file.read_as_float(e, storage.back().data());
  }
  for (size_t i = 0; i < file.entries().size(); ++i)
    refs.push_back({file.entries()[i].name, file.entries()[i].shape, storage[i].data()});
  edit(refs);
  write_safetensors(path + ".new", refs, SafetensorsDType::F32, {{"format", "pt"}});
  std::filesystem::rename(path + ".new", path);
}

class HfImportBadWeights : public ::testing::Test {
 protected:
  void SetUp() override {
    params_ = std::make_unique<FlatParameters>(tiny_model(false, 0));
    fill_pattern(*params_);
    out_ = dir_.file("out");
    save_hf_model(out_, *params_);
  }
  std::string import_error() { return error_of([&] { load_hf_model(out_); }); }

  TempDir dir_;
  std::unique_ptr<FlatParameters> params_;
  std::string out_;
};

TEST_F(HfImportBadWeights, MissingTensorIsNamed) {
  rewrite_weights(out_, [](auto& refs) {
    std::erase_if(refs, [](const auto& r) { return r.name == "model.layers.1.self_attn.k_proj.weight"; });
  });
  std::string e = import_error();
  EXPECT_NE(e.find("no tensor 'model.layers.1.self_attn.k_proj.weight'"), std::string::npos) << e;
  EXPECT_NE(e.find("layers.1.attention.qkv.weight"), std::string::npos) << e;
}

TEST_F(HfImportBadWeights, WrongShapeNamesFileTensorAndShapes) {
  std::vector<float> big(24 * 32);
  rewrite_weights(out_, [&](auto& refs) {
    for (auto& r : refs)
      if (r.name == "model.layers.0.mlp.up_proj.weight") r = {r.name, {24, 32}, big.data()};
  });
  std::string e = import_error();
  EXPECT_NE(e.find(out_ + "/model.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("'model.layers.0.mlp.up_proj.weight' has shape [24, 32], but the model's architecture needs [24, 16]"),
            std::string::npos)
      << e;
}

TEST_F(HfImportBadWeights, UnexpectedTensorIsAnErrorButInvFreqIsIgnored) {
  std::vector<float> extra(16);
  rewrite_weights(out_, [&](auto& refs) {
    refs.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {2}, extra.data()});
  });
  HfModel model = load_hf_model(out_);
  expect_same_weights(*params_, *model.params);
  rewrite_weights(out_, [&](auto& refs) { refs.push_back({"model.layers.0.self_attn.q_proj.bias", {16}, extra.data()}); });
  std::string e = import_error();
  EXPECT_NE(e.find("1 tensor(s) that a Llama model does not have: model.layers.0.self_attn.q_proj.bias"),
            std::string::npos)
      << e;
}

TEST(HfImportShards, IndexMustAgreeWithTheShards) {
  TempDir dir;
  FlatParameters params(tiny_model(false, 0));
  HfExportOptions options;
  options.max_shard_bytes = 2000;
  const std::string out = dir.file("out");
  save_hf_model(out, params, options);
  const std::string index_path = out + "/model.safetensors.index.json";
  json index = json::parse(std::ifstream(index_path));
  auto with_index = [&](const json& edited) {
    std::ofstream(index_path) << edited.dump();
    return error_of([&] { load_hf_model(out); });
  };
  const std::string first_shard = index["weight_map"]["model.embed_tokens.weight"];
  json moved = index;
  moved["weight_map"]["model.norm.weight"] = first_shard;
  EXPECT_NE(with_index(moved).find("maps 'model.norm.weight' to '" + first_shard + "', which does not hold it"),
            std::string::npos);
  json missing = index;
  missing["weight_map"]["model.norm.weight"] = "model-00099-of-00099.safetensors";
  EXPECT_NE(with_index(missing).find("shard 'model-00099-of-00099.safetensors'"), std::string::npos);
  json escaping = index;
  escaping["weight_map"]["model.norm.weight"] = "../model.safetensors";
  EXPECT_NE(with_index(escaping).find("expected a file name in the same directory"), std::string::npos);
  // Longer than a file name may be: refused by the index check, not by the system's lookup
  // (found by fuzz_hf_weight_index, which saw std::filesystem throw "File name too long").
  json too_long = index;
  too_long["weight_map"]["model.norm.weight"] = std::string(300, 'I') + ".safetensors";
  EXPECT_NE(with_index(too_long).find("expected a file name in the same directory (at most 255 bytes)"),
            std::string::npos);
  json unlisted = index;
  unlisted["weight_map"].erase("model.norm.weight");
  EXPECT_NE(with_index(unlisted).find("holds 'model.norm.weight', which the index maps to no file"), std::string::npos);
}

TEST(HfImportShards, DirectoryWithoutWeights) {
  TempDir dir;
  std::filesystem::create_directories(dir.file("m"));
  std::ofstream(dir.file("m/config.json")) << llama_json().dump();
  std::string e = error_of([&] { load_hf_model(dir.file("m")); });
  EXPECT_NE(e.find("has neither model.safetensors nor model.safetensors.index.json"), std::string::npos) << e;
  e = error_of([&] { load_hf_model(dir.file("nothing")); });
  EXPECT_NE(e.find(dir.file("nothing") + "/config.json"), std::string::npos) << e;
}

TEST(HfExport, RefusesToOverwriteANonEmptyDirectory) {
  TempDir dir;
  FlatParameters params(tiny_model(false, 0));
  std::filesystem::create_directories(dir.file("out"));
  std::ofstream(dir.file("out/keep.txt")) << "precious";
  std::string e = error_of([&] { save_hf_model(dir.file("out"), params); });
  EXPECT_NE(e.find("refusing to overwrite"), std::string::npos) << e;
  EXPECT_TRUE(std::filesystem::exists(dir.file("out/keep.txt")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("out/model.safetensors")));
  std::filesystem::create_directories(dir.file("empty"));
  save_hf_model(dir.file("empty"), params);
  EXPECT_TRUE(std::filesystem::exists(dir.file("empty/config.json")));
  for (const auto& entry : std::filesystem::directory_iterator(dir.file("")))
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos) << entry.path();
}

TEST(HfExport, CarriesTokenizerFilesAndSpecialTokensFromTheSource) {
  TempDir dir;
  FlatParameters params(tiny_model(false, 0));
  const std::string source = dir.file("source");
  save_hf_model(source, params);
  json config = json::parse(std::ifstream(source + "/config.json"));
  config["bos_token_id"] = 7;
  config["eos_token_id"] = json::array({8, 9});
  std::ofstream(source + "/config.json") << config.dump();
  std::ofstream(source + "/tokenizer.json") << "{\"model\": {}}";
  std::ofstream(source + "/generation_config.json") << "{\"bos_token_id\": 7}";
  HfExportOptions options;
  options.source_dir = source;
  save_hf_model(dir.file("out"), params, options);
  json written = json::parse(std::ifstream(dir.file("out/config.json")));
  EXPECT_EQ(written["bos_token_id"], 7);
  EXPECT_EQ(written["eos_token_id"], json::array({8, 9}));
  EXPECT_TRUE(std::filesystem::exists(dir.file("out/tokenizer.json")));
  EXPECT_TRUE(std::filesystem::exists(dir.file("out/generation_config.json")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("out/tokenizer.model")));
}

TEST(HfExport, KeepsTheSourcesClassAndConfigFields) {
  // NOTE [Export keeps the source's config]: a Mistral with "sliding_window": null stays
  // Mistral, unknown keys ride along, and the keys forge writes take the exported values.
  TempDir dir;
  FlatParameters params(tiny_model(false, 0));
  const std::string source = dir.file("source");
  save_hf_model(source, params);
  json config = json::parse(std::ifstream(source + "/config.json"));
  config["architectures"] = {"MistralForCausalLM"};
  config["model_type"] = "mistral";
  config["sliding_window"] = nullptr;
  config.erase("attention_bias");
  config.erase("mlp_bias");
  config["_name_or_path"] = "mistralai/Tiny";
  config["some_future_field"] = json::object({{"x", 1}});
  config["rms_norm_eps"] = 0.5;  // forge's value (1e-5, params' config) must replace it
  std::ofstream(source + "/config.json") << config.dump();
  HfExportOptions options;
  options.source_dir = source;
  options.dtype = SafetensorsDType::F16;
  save_hf_model(dir.file("out"), params, options);
  json written = json::parse(std::ifstream(dir.file("out/config.json")));
  EXPECT_EQ(written["architectures"], json::array({"MistralForCausalLM"}));
  EXPECT_EQ(written["model_type"], "mistral");
  EXPECT_TRUE(written["sliding_window"].is_null());
  EXPECT_FALSE(written.contains("attention_bias"));
  EXPECT_EQ(written["_name_or_path"], "mistralai/Tiny");
  EXPECT_EQ(written["some_future_field"]["x"], 1);
  EXPECT_EQ(written["rms_norm_eps"], 1e-5);
  EXPECT_EQ(written["dtype"], "float16");
  EXPECT_EQ(written["torch_dtype"], "float16");
  EXPECT_EQ(model_config_from_hf(written, "out").sliding_window, 0);
}

TEST(HfImportWeights, F16ExportRoundsEachWeight) {
  TempDir dir;
  FlatParameters params(tiny_model(false, 0));
  fill_pattern(params);
  save_hf_model(dir.file("out"), params, {.dtype = SafetensorsDType::F16});
  HfModel back = load_hf_model(dir.file("out"));
  const float* want = params.flat().data<float>();
  const float* got = back.params->flat().data<float>();
  for (int64_t i = 0; i < params.flat().numel(); ++i) ASSERT_EQ(got[i], f16_to_float(float_to_f16(want[i]))) << i;
}

TEST(HfConfigNames, ModelNamesAndDeclaredDtypes) {
  EXPECT_EQ(hf_model_name("/models/Llama-3.2-1B"), "Llama-3.2-1B");
  EXPECT_EQ(hf_model_name("/models/Llama-3.2-1B/"), "Llama-3.2-1B");
  EXPECT_EQ(hf_model_name("/hub/models--mistralai--Mistral-7B-v0.1/snapshots/26bca36b"), "Mistral-7B-v0.1");
  EXPECT_EQ(hf_declared_dtype(json::parse(R"({"dtype": "bfloat16", "torch_dtype": "float32"})"), "c"), "bfloat16");
  EXPECT_EQ(hf_declared_dtype(json::parse(R"({"torch_dtype": "float16"})"), "c"), "float16");
  EXPECT_EQ(hf_declared_dtype(json::parse(R"({"dtype": null})"), "c"), "");
  const std::string e = error_of([] { hf_declared_dtype(json::parse(R"({"torch_dtype": "int8"})"), "/m/config.json"); });
  EXPECT_NE(e.find("/m/config.json: \"torch_dtype\" is \"int8\""), std::string::npos) << e;
}

// A Mixtral as the hub's config.json gives it (mistralai/Mixtral-8x7B-v0.1's keys, tiny).
json mixtral_json() {
  return json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 40, "hidden_size": 16,
    "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05, "max_position_embeddings": 64, "hidden_act": "silu", "tie_word_embeddings": false,
    "rope_theta": 1000000.0, "sliding_window": null, "num_local_experts": 3, "num_experts_per_tok": 2,
    "output_router_logits": false, "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16"
  })");
}

ModelConfig tiny_mixtral() { return model_config_from_hf(mixtral_json(), "config.json"); }

TEST(HfImportConfig, MapsMixtralKeys) {
  ModelConfig m = tiny_mixtral();
  EXPECT_EQ(m.num_experts, 3);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  EXPECT_EQ(m.router_aux_loss_coef, 0.0);  // output_router_logits false: transformers trains without it
  EXPECT_EQ(m.rope_theta, 1e6);
  EXPECT_EQ(m.sliding_window, 0);
  EXPECT_EQ(m.ffn_hidden_size, 12);
  json c = mixtral_json();
  c["output_router_logits"] = true;
  c["sliding_window"] = 7;
  m = model_config_from_hf(c, "config.json");
  EXPECT_EQ(m.router_aux_loss_coef, 0.02);
  EXPECT_EQ(m.sliding_window, 7);
  c.erase("router_aux_loss_coef");
  EXPECT_EQ(model_config_from_hf(c, "config.json").router_aux_loss_coef, 0.001);  // MixtralConfig's default
  c = mixtral_json();
  c.erase("architectures");
  EXPECT_EQ(model_config_from_hf(c, "config.json").num_experts, 3);  // by model_type
  EXPECT_EQ(hf_model_family(mixtral_json(), "config.json"), "mixtral");
}

// mistralai/Mixtral-8x7B-v0.1's config.json is forge's mixtral-8x7b model file.
TEST(HfImportConfig, PublishedMixtral8x7bIsTheCatalogModel) {
  const json published = json::parse(R"({
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
    "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": null,
    "tie_word_embeddings": false, "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0",
    "use_cache": true, "vocab_size": 32000
  })");
  const ModelConfig hf = model_config_from_hf(published, "config.json");
  const ModelConfig catalog = load_experiment("", {{"model.name", "mixtral-8x7b"}}).model;
  EXPECT_TRUE(architecture_differences(catalog, hf).empty())
      << fmt::format("{}", fmt::join(architecture_differences(catalog, hf), "; "));
  EXPECT_EQ(hf.total_params(), 46702792704);
  EXPECT_EQ(hf.router_aux_loss_coef, catalog.router_aux_loss_coef);  // 0: the 0.02 is dormant
}

TEST(HfImportConfig, AppliesMixtralConfigDefaults) {
  json c = mixtral_json();
  for (const char* key : {"num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "rope_theta",
                          "sliding_window", "num_local_experts", "num_experts_per_tok", "output_router_logits",
                          "router_aux_loss_coef"})
    c.erase(key);
  c["num_attention_heads"] = 8;
  c["hidden_size"] = 32;
  ModelConfig m = model_config_from_hf(c, "config.json");
  EXPECT_EQ(m.num_kv_heads, 8);  // MixtralConfig's default, not num_attention_heads
  EXPECT_EQ(m.norm_eps, 1e-5);
  EXPECT_EQ(m.max_seq_len, 4096 * 32);
  EXPECT_EQ(m.rope_theta, 1e6);
  EXPECT_EQ(m.sliding_window, 0);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  EXPECT_EQ(m.router_aux_loss_coef, 0.0);
}

TEST(HfImportConfig, RejectsUnsupportedMixtralsNamingFileAndKey) {
  json c = mixtral_json();
  c["router_jitter_noise"] = 0.1;
  expect_error(c, "\"router_jitter_noise\" is 0.1; forge's router has no jitter");
  c = mixtral_json();
  c["num_local_experts"] = "3";
  expect_error(c, "\"num_local_experts\" is \"3\", expected a positive integer");
  c = mixtral_json();
  c["num_experts_per_tok"] = 4;
  expect_error(c, "model.num_experts_per_tok (4) must be between 1 and model.num_experts (3)");
  c = mixtral_json();
  c["router_aux_loss_coef"] = -1;
  expect_error(c, "\"router_aux_loss_coef\" is -1, expected a number >= 0");
  c = mixtral_json();
  c["architectures"] = {"Qwen2MoeForCausalLM"};
  expect_error(c, "\"architectures\" is [\"Qwen2MoeForCausalLM\"]; forge imports LlamaForCausalLM, "
                  "MistralForCausalLM, MixtralForCausalLM, DeepseekV2ForCausalLM and DeepseekV3ForCausalLM");
}

TEST(HfImportConfig, ExportedMixtralConfigReadsBackAsTheSameModel) {
  for (double coefficient : {0.0, 0.05})
    for (int64_t window : {0, 6}) {
      ModelConfig m = tiny_mixtral();
      m.router_aux_loss_coef = coefficient;
      m.sliding_window = window;
      json written = json::parse(hf_config_from_model(m, "bfloat16").dump());
      EXPECT_EQ(written["architectures"], json::array({"MixtralForCausalLM"}));
      EXPECT_EQ(written["model_type"], "mixtral");
      EXPECT_EQ(written["num_local_experts"], 3);
      EXPECT_EQ(written["num_experts_per_tok"], 2);
      EXPECT_EQ(written["output_router_logits"], coefficient > 0);
      EXPECT_EQ(written.contains("router_aux_loss_coef"), coefficient > 0);
      EXPECT_EQ(written["router_jitter_noise"], 0.0);
      EXPECT_FALSE(written.contains("attention_bias"));
      if (window == 0) EXPECT_TRUE(written["sliding_window"].is_null());
      ModelConfig back = model_config_from_hf(written, "config.json");
      EXPECT_TRUE(architecture_differences(m, back).empty())
          << fmt::format("{}", fmt::join(architecture_differences(m, back), "; "));
      EXPECT_EQ(back.router_aux_loss_coef, coefficient);
    }
  std::string e = error_of([] { hf_config_from_model(tiny_mixtral(), "float32", "llama"); });
  EXPECT_NE(e.find("a Mixture-of-Experts model cannot be written as a llama model"), std::string::npos) << e;
  e = error_of([] { hf_config_from_model(tiny_model(false, 0), "float32", "mixtral"); });
  EXPECT_NE(e.find("a dense model cannot be written as a mixtral model"), std::string::npos) << e;
}

TEST(HfImportConfig, ArchitectureDifferencesNameTheExperts) {
  ModelConfig a = tiny_mixtral(), b = tiny_mixtral();
  b.num_experts = 4;
  EXPECT_EQ(architecture_differences(a, b), std::vector<std::string>{"model.num_experts: 3 here, 4 in config.json"});
  EXPECT_NE(model_overrides_for(b).find("--model.num_experts 4 --model.num_experts_per_tok 2"), std::string::npos);
}

// NOTE [MoE Hugging Face names]: forge's stacks are the per-expert matrices one after another.
TEST(HfLayout, MixtralExpertsAreSlicesOfTheStacks) {
  const ModelConfig m = tiny_mixtral();
  const int64_t E = 3, F = 12, H = 16;
  std::map<std::string, std::vector<HfPart>> parts;
  for (const ParamSpec& spec : parameter_specs(m))
    if (spec.layer == 1) parts[spec.name] = hf_parts(spec);
  const auto& router = parts.at("layers.1.moe.router.weight");
  ASSERT_EQ(router.size(), 1u);
  EXPECT_EQ(router[0].name, "model.layers.1.block_sparse_moe.gate.weight");
  EXPECT_EQ(router[0].shape, (Shape{E, H}));
  const auto& gate_up = parts.at("layers.1.moe.experts.gate_up");
  ASSERT_EQ(gate_up.size(), static_cast<size_t>(2 * E));
  const auto& down = parts.at("layers.1.moe.experts.down");
  ASSERT_EQ(down.size(), static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    const std::string expert = fmt::format("model.layers.1.block_sparse_moe.experts.{}.", e);
    const HfPart& w1 = gate_up[static_cast<size_t>(2 * e)];
    const HfPart& w3 = gate_up[static_cast<size_t>(2 * e + 1)];
    const HfPart& w2 = down[static_cast<size_t>(e)];
    EXPECT_EQ(w1.name, expert + "w1.weight");
    EXPECT_EQ(w3.name, expert + "w3.weight");
    EXPECT_EQ(w2.name, expert + "w2.weight");
    EXPECT_EQ(w1.shape, (Shape{F, H}));
    EXPECT_EQ(w3.shape, (Shape{F, H}));
    EXPECT_EQ(w2.shape, (Shape{H, F}));
    EXPECT_EQ(w1.offset, e * 2 * F * H);  // expert e's [2F, H] block: gate rows, then up rows
    EXPECT_EQ(w3.offset, e * 2 * F * H + F * H);
    EXPECT_EQ(w2.offset, e * H * F);
  }
  // A dense model's layout is unchanged: gate_up is gate_proj then up_proj along dim 0.
  for (const ParamSpec& spec : parameter_specs(tiny_model(false, 0)))
    if (spec.name == "layers.0.mlp.gate_up.weight") {
      const std::vector<HfPart> dense = hf_parts(spec);
      ASSERT_EQ(dense.size(), 2u);
      EXPECT_EQ(dense[1].name, "model.layers.0.mlp.up_proj.weight");
      EXPECT_EQ(dense[1].shape, (Shape{24, 16}));
      EXPECT_EQ(dense[1].offset, 24 * 16);
    }
}

TEST(HfImportWeights, MixtralExportImportRoundTripIsExact) {
  for (uint64_t shard_bytes : {uint64_t{5'000'000'000}, uint64_t{3000}}) {
    TempDir dir;
    FlatParameters params(tiny_mixtral());
    fill_pattern(params);
    HfExportOptions options;
    options.max_shard_bytes = shard_bytes;
    save_hf_model(dir.file("out"), params, options);
    HfModel model = load_hf_model(dir.file("out"));
    EXPECT_TRUE(architecture_differences(params.config(), model.config).empty());
    expect_same_weights(params, *model.params);
    if (shard_bytes > 3000) {
      SafetensorsFile file(dir.file("out/model.safetensors"));
      size_t experts = 0;
      for (const auto& e : file.entries()) {
        EXPECT_EQ(e.name.find(".mlp."), std::string::npos) << e.name;  // the published names only
        experts += e.name.find(".block_sparse_moe.experts.") != std::string::npos;
      }
      EXPECT_EQ(experts, 2u * 3u * 3u);  // layers x experts x (w1, w2, w3)
    }
  }
}

// transformers 5's save_pretrained(save_original_format=False) writes its in-memory names:
// whole stacks, in forge's own layout (ParamSpec::hf_alias).
TEST(HfImportWeights, MixtralFromTransformers5InMemoryNames) {
  TempDir dir;
  FlatParameters params(tiny_mixtral());
  fill_pattern(params);
  const std::string out = dir.file("out");
  save_hf_model(out, params);
  const auto fuse = [&](std::vector<SafetensorsTensorRef>& refs) {
    std::erase_if(refs, [](const auto& r) { return r.name.find(".block_sparse_moe.") != std::string::npos; });
    for (int layer = 0; layer < 2; ++layer) {
      const std::string hf = fmt::format("model.layers.{}.mlp.", layer), p = fmt::format("layers.{}.moe.", layer);
      refs.push_back({hf + "gate.weight", {3, 16}, params.find(p + "router.weight").data<float>()});
      refs.push_back({hf + "experts.gate_up_proj", {3, 24, 16}, params.find(p + "experts.gate_up").data<float>()});
      refs.push_back({hf + "experts.down_proj", {3, 16, 12}, params.find(p + "experts.down").data<float>()});
    }
  };
  rewrite_weights(out, fuse);
  expect_same_weights(params, *load_hf_model(out).params);
  // Both forms of one parameter at once are refused, naming both.
  save_hf_model(dir.file("both"), params);
  std::vector<float> stack(3 * 24 * 16);
  rewrite_weights(dir.file("both"), [&](auto& refs) {
    refs.push_back({"model.layers.1.mlp.experts.gate_up_proj", {3, 24, 16}, stack.data()});
  });
  const std::string e = error_of([&] { load_hf_model(dir.file("both")); });
  EXPECT_NE(e.find("holds both 'model.layers.1.mlp.experts.gate_up_proj' and "
                   "'model.layers.1.block_sparse_moe.experts.0.w1.weight'"),
            std::string::npos)
      << e;
}

class HfImportBadMixtral : public ::testing::Test {
 protected:
  void SetUp() override {
    params_ = std::make_unique<FlatParameters>(tiny_mixtral());
    fill_pattern(*params_);
    out_ = dir_.file("out");
    save_hf_model(out_, *params_);
  }
  std::string import_error() { return error_of([&] { load_hf_model(out_); }); }
  void set_config(const std::function<void(json&)>& edit) {
    json config = json::parse(std::ifstream(out_ + "/config.json"));
    edit(config);
    std::ofstream(out_ + "/config.json") << config.dump();
  }

  TempDir dir_;
  std::unique_ptr<FlatParameters> params_;
  std::string out_;
};

TEST_F(HfImportBadMixtral, MissingExpertTensorIsNamed) {
  rewrite_weights(out_, [](auto& refs) {
    std::erase_if(refs, [](const auto& r) { return r.name == "model.layers.1.block_sparse_moe.experts.2.w3.weight"; });
  });
  const std::string e = import_error();
  EXPECT_NE(e.find(out_ + ": no tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight' in the weight files "
                          "(expected [12, 16] for forge's 'layers.1.moe.experts.gate_up', or "
                          "'model.layers.1.mlp.experts.gate_up_proj' [3, 24, 16] whole)"),
            std::string::npos)
      << e;
}

TEST_F(HfImportBadMixtral, WrongExpertShapeNamesFileTensorAndShapes) {
  std::vector<float> big(12 * 20);
  rewrite_weights(out_, [&](auto& refs) {
    for (auto& r : refs)
      if (r.name == "model.layers.0.block_sparse_moe.experts.1.w2.weight") r = {r.name, {20, 12}, big.data()};
  });
  const std::string e = import_error();
  EXPECT_NE(e.find(out_ + "/model.safetensors: tensor 'model.layers.0.block_sparse_moe.experts.1.w2.weight' has "
                          "shape [20, 12], but the model's architecture needs [16, 12]"),
            std::string::npos)
      << e;
}

TEST_F(HfImportBadMixtral, ExpertCountDisagreeingWithConfigIsRefused) {
  // config.json says fewer experts than the files hold: the router's shape is wrong.
  set_config([](json& c) { c["num_local_experts"] = 2; });
  std::string e = import_error();
  EXPECT_NE(e.find("tensor 'model.layers.0.block_sparse_moe.gate.weight' has shape [3, 16], but the model's "
                   "architecture needs [2, 16]"),
            std::string::npos)
      << e;
  // More than the files hold.
  set_config([](json& c) { c["num_local_experts"] = 4; });
  e = import_error();
  EXPECT_NE(e.find("has shape [3, 16], but the model's architecture needs [4, 16]"), std::string::npos) << e;
  // A router that agrees with config.json, but an expert the config does not have.
  set_config([](json& c) { c["num_local_experts"] = 3; });
  std::vector<float> extra(12 * 16);
  rewrite_weights(out_, [&](auto& refs) {
    refs.push_back({"model.layers.0.block_sparse_moe.experts.3.w1.weight", {12, 16}, extra.data()});
  });
  e = import_error();
  EXPECT_NE(e.find("1 tensor(s) that a Mixtral model does not have: model.layers.0.block_sparse_moe.experts.3.w1.weight "
                   "(config.json's num_local_experts is 3: experts 0 to 2)"),
            std::string::npos)
      << e;
}

TEST(HfExport, MixtralKeepsTheSourcesDormantBalancingCoefficient) {
  // NOTE [Mixtral config keys]: the published Mixtral's 0.02 with output_router_logits false
  // is forge's 0, and its export keeps the 0.02; a coefficient forge trains with replaces it.
  TempDir dir;
  const std::string source = dir.file("source");
  std::filesystem::create_directories(source);
  std::ofstream(source + "/config.json") << mixtral_json().dump();
  FlatParameters params(tiny_mixtral());
  HfExportOptions options;
  options.source_dir = source;
  save_hf_model(dir.file("out"), params, options);
  json written = json::parse(std::ifstream(dir.file("out/config.json")));
  EXPECT_EQ(written["architectures"], json::array({"MixtralForCausalLM"}));
  EXPECT_EQ(written["router_aux_loss_coef"], 0.02);
  EXPECT_EQ(written["output_router_logits"], false);
  ModelConfig trained = tiny_mixtral();
  trained.router_aux_loss_coef = 0.3;
  save_hf_model(dir.file("trained"), FlatParameters(trained), options);
  written = json::parse(std::ifstream(dir.file("trained/config.json")));
  EXPECT_EQ(written["router_aux_loss_coef"], 0.3);
  EXPECT_EQ(written["output_router_logits"], true);
}

// DeepSeek-V2-Lite's config.json keys (deepseek-ai/DeepSeek-V2-Lite), tiny: MLA with
// uncompressed queries, one dense block, 2 shared experts, greedy top-2 softmax routing, YaRN.
json deepseek_v2_json() {
  return json::parse(R"({
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 40, "hidden_size": 16,
    "intermediate_size": 24, "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
    "num_key_value_heads": 2, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 2,
    "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": null, "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4, "v_head_dim": 6, "max_position_embeddings": 64, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 0.707,
    "mscale_all_dim": 0.707, "original_max_position_embeddings": 16, "type": "yarn"},
    "norm_topk_prob": false, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "scoring_func": "softmax", "moe_layer_freq": 1, "aux_loss_alpha": 0.001, "seq_aux": true, "ep_size": 1,
    "hidden_act": "silu", "attention_bias": false, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
  })");
}

// DeepSeek-V3's config.json keys (deepseek-ai/DeepSeek-V3, without its FP8 quantization_config),
// tiny: a compressed query, group-limited sigmoid routing with the bias, renormalized, x 2.5.
json deepseek_v3_json() {
  return json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 40, "hidden_size": 16,
    "intermediate_size": 24, "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2,
    "num_key_value_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": 12, "qk_nope_head_dim": 4,
    "qk_rope_head_dim": 4, "v_head_dim": 6, "max_position_embeddings": 64, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0,
    "mscale_all_dim": 0.8, "original_max_position_embeddings": 16, "type": "yarn"},
    "norm_topk_prob": true, "routed_scaling_factor": 2.5, "topk_method": "noaux_tc", "n_group": 4, "topk_group": 2,
    "scoring_func": "sigmoid", "moe_layer_freq": 1, "aux_loss_alpha": 0.001, "seq_aux": true, "ep_size": 1,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "attention_bias": false, "tie_word_embeddings": false,
    "torch_dtype": "bfloat16"
  })");
}

// A value as a file of `dtype` holds it.
float round_to(SafetensorsDType dtype, float value) {
  return dtype == SafetensorsDType::BF16 ? bf16_to_float(float_to_bf16(value)) : value;
}

std::string read_file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

ModelConfig tiny_deepseek(bool v3) { return model_config_from_hf(v3 ? deepseek_v3_json() : deepseek_v2_json(), "config.json"); }

TEST(HfImportConfig, MapsDeepseekV2Keys) {
  const ModelConfig m = tiny_deepseek(false);
  EXPECT_EQ(m.num_heads, 2);
  EXPECT_EQ(m.num_kv_heads, 2);
  EXPECT_EQ(m.head_dim, 0);
  EXPECT_EQ(m.q_lora_rank, 0);  // null: uncompressed queries
  EXPECT_EQ(m.kv_lora_rank, 8);
  EXPECT_EQ(m.qk_nope_head_dim, 4);
  EXPECT_EQ(m.qk_rope_head_dim, 4);
  EXPECT_EQ(m.v_head_dim, 6);
  EXPECT_EQ(m.ffn_hidden_size, 24);
  EXPECT_EQ(m.moe_ffn_hidden_size, 8);
  EXPECT_EQ(m.num_experts, 4);
  EXPECT_EQ(m.num_experts_per_tok, 2);
  EXPECT_EQ(m.num_shared_experts, 2);
  EXPECT_EQ(m.first_dense_layers, 1);
  EXPECT_EQ(m.router_score_function, "softmax");
  EXPECT_FALSE(m.router_normalize_topk);
  EXPECT_EQ(m.router_scaling_factor, 1.0);
  EXPECT_EQ(m.router_num_groups, 1);
  EXPECT_EQ(m.router_aux_loss_coef, 0.0);  // aux_loss_alpha: transformers computes no balancing loss
  EXPECT_EQ(m.norm_eps, 1e-6);
  EXPECT_EQ(m.max_seq_len, 64);
  EXPECT_TRUE(m.rope_scaling.yarn());
  EXPECT_EQ(m.rope_scaling.factor, 4.0);
  EXPECT_EQ(m.rope_scaling.original_max_position, 16);
  EXPECT_EQ(m.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(m.rope_scaling.beta_slow, 1.0);
  EXPECT_EQ(m.rope_scaling.mscale, 0.707);
  EXPECT_EQ(m.rope_scaling.mscale_all_dim, 0.707);
  EXPECT_EQ(hf_model_family(deepseek_v2_json(), "config.json"), "deepseek_v2");
  const HfWeightLayout layout = hf_weight_layout(deepseek_v2_json(), "config.json");
  EXPECT_TRUE(layout.interleaved_rotary);
  EXPECT_EQ(layout.extra_layers, 0);
  json c = deepseek_v2_json();
  c.erase("architectures");
  EXPECT_EQ(model_config_from_hf(c, "config.json").kv_lora_rank, 8);  // by model_type
  // transformers 5's rope_parameters, with beta_fast and beta_slow null (32 and 1).
  c = deepseek_v2_json();
  c.erase("rope_scaling");
  c["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 500.0}, {"factor", 2.0}, {"beta_fast", nullptr},
                          {"beta_slow", 0}, {"original_max_position_embeddings", 8}};
  ModelConfig m2 = model_config_from_hf(c, "config.json");
  EXPECT_EQ(m2.rope_theta, 500.0);
  EXPECT_EQ(m2.rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(m2.rope_scaling.beta_slow, 1.0);
  EXPECT_EQ(m2.rope_scaling.mscale, 0.0);
  // A top-level original_max_position_embeddings wins, as in transformers.
  c["original_max_position_embeddings"] = 4;
  EXPECT_EQ(model_config_from_hf(c, "config.json").rope_scaling.original_max_position, 4);
  // An attention_factor equal to forge's is accepted.
  c = deepseek_v2_json();
  c["rope_scaling"]["attention_factor"] = rope_attention_factor(m.rope_scaling);
  EXPECT_EQ(model_config_from_hf(c, "config.json").rope_scaling.mscale, 0.707);
}

// DeepSeek-V2's 236B models route group-limited (group_limited_greedy) with scaled softmax
// weights; transformers' DeepseekV2TopkRouter reads n_group, topk_group and
// routed_scaling_factor, and so does forge; the written config routes the same.
TEST(HfImportConfig, MapsDeepseekV2GroupLimitedScaledRouting) {
  json c = deepseek_v2_json();
  c["topk_method"] = "group_limited_greedy";
  c["n_group"] = 2;
  c["topk_group"] = 1;
  c["routed_scaling_factor"] = 16.0;
  const ModelConfig m = model_config_from_hf(c, "config.json");
  EXPECT_EQ(m.router_score_function, "softmax");
  EXPECT_EQ(m.router_num_groups, 2);
  EXPECT_EQ(m.router_topk_groups, 1);
  EXPECT_EQ(m.router_scaling_factor, 16.0);
  EXPECT_FALSE(m.router_normalize_topk);
  const json written = json::parse(hf_config_from_model(m, "float32").dump());
  EXPECT_EQ(written["topk_method"], "group_limited_greedy");
  EXPECT_EQ(written["n_group"], 2);
  EXPECT_EQ(written["topk_group"], 1);
  EXPECT_EQ(written["routed_scaling_factor"], 16.0);
  EXPECT_TRUE(architecture_differences(m, model_config_from_hf(written, "config.json")).empty());
}

TEST(HfImportConfig, MapsDeepseekV3Keys) {
  const ModelConfig m = tiny_deepseek(true);
  EXPECT_EQ(m.q_lora_rank, 12);
  EXPECT_EQ(m.num_experts, 8);
  EXPECT_EQ(m.num_experts_per_tok, 3);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_EQ(m.router_score_function, "sigmoid");
  EXPECT_TRUE(m.router_normalize_topk);
  EXPECT_EQ(m.router_scaling_factor, 2.5);
  EXPECT_EQ(m.router_num_groups, 4);
  EXPECT_EQ(m.router_topk_groups, 2);
  EXPECT_EQ(m.router_aux_loss_coef, 0.0);
  EXPECT_EQ(m.rope_scaling.mscale_all_dim, 0.8);
  EXPECT_EQ(hf_model_family(deepseek_v3_json(), "config.json"), "deepseek_v3");
  HfWeightLayout layout = hf_weight_layout(deepseek_v3_json(), "config.json");
  EXPECT_TRUE(layout.interleaved_rotary);
  EXPECT_EQ(layout.extra_layers, 1);
  json c = deepseek_v3_json();
  c["rope_interleave"] = false;
  c["num_nextn_predict_layers"] = 0;
  layout = hf_weight_layout(c, "config.json");
  EXPECT_FALSE(layout.interleaved_rotary);
  EXPECT_EQ(layout.extra_layers, 0);
  c = deepseek_v3_json();
  c["norm_topk_prob"] = false;
  c.erase("topk_method");
  c.erase("scoring_func");
  EXPECT_FALSE(model_config_from_hf(c, "config.json").router_normalize_topk);
}

TEST(HfImportConfig, AppliesDeepseekConfigDefaults) {
  json c = json::parse(R"({"architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 40, "hidden_size": 32,
                           "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts_per_tok": 6})");
  ModelConfig m = model_config_from_hf(c, "config.json");  // DeepseekV2Config's defaults
  EXPECT_EQ(m.num_kv_heads, 2);
  EXPECT_EQ(m.q_lora_rank, 1536);
  EXPECT_EQ(m.kv_lora_rank, 512);
  EXPECT_EQ(m.qk_nope_head_dim, 128);
  EXPECT_EQ(m.qk_rope_head_dim, 64);
  EXPECT_EQ(m.v_head_dim, 128);
  EXPECT_EQ(m.num_experts, 64);
  EXPECT_EQ(m.moe_ffn_hidden_size, 1407);
  EXPECT_EQ(m.num_shared_experts, 2);
  EXPECT_EQ(m.first_dense_layers, 0);
  EXPECT_EQ(m.ffn_hidden_size, 11008);
  EXPECT_EQ(m.max_seq_len, 2048);
  EXPECT_EQ(m.norm_eps, 1e-6);
  EXPECT_EQ(m.rope_theta, 10000.0);
  EXPECT_FALSE(m.rope_scaling.enabled);
  EXPECT_FALSE(m.router_normalize_topk);
  c.erase("num_experts_per_tok");
  expect_error(c, "\"num_experts_per_tok\" is missing (expected a positive integer; DeepseekV2Config has no default)");
  // DeepseekV3Config's: 128 key/value heads, so the key must be there unless there are 128 heads.
  c = json::parse(R"({"architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 40, "hidden_size": 128,
                      "num_hidden_layers": 4, "num_attention_heads": 128})");
  m = model_config_from_hf(c, "config.json");
  EXPECT_EQ(m.num_kv_heads, 128);
  EXPECT_EQ(m.num_experts, 256);
  EXPECT_EQ(m.num_experts_per_tok, 8);
  EXPECT_EQ(m.moe_ffn_hidden_size, 2048);
  EXPECT_EQ(m.num_shared_experts, 1);
  EXPECT_EQ(m.first_dense_layers, 3);
  EXPECT_EQ(m.ffn_hidden_size, 18432);
  EXPECT_EQ(m.router_num_groups, 8);
  EXPECT_EQ(m.router_topk_groups, 4);
  EXPECT_TRUE(m.router_normalize_topk);
  EXPECT_EQ(m.router_scaling_factor, 2.5);
  EXPECT_EQ(m.max_seq_len, 4096);
  c["num_attention_heads"] = 4;
  expect_error(c, "\"num_key_value_heads\" is 128 (DeepseekV3Config's default, the key being absent); Multi-head "
                  "Latent Attention gives each of the 4 heads (\"num_attention_heads\") keys and values of its own: "
                  "expected 4");
}

// deepseek-ai/DeepSeek-V2-Lite's and deepseek-ai/DeepSeek-V3's config.json are forge's
// deepseek-v2-lite and deepseek-v3 model files (V3's without its FP8 quantization_config,
// which is refused).
TEST(HfImportConfig, PublishedDeepseekModelsAreTheCatalogModels) {
  const json lite = json::parse(R"({
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": false, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": null,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": true,
    "tie_word_embeddings": false, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128, "vocab_size": 102400
  })");
  ModelConfig hf = model_config_from_hf(lite, "config.json");
  ModelConfig catalog = load_experiment("", {{"model.name", "deepseek-v2-lite"}}).model;
  EXPECT_TRUE(architecture_differences(catalog, hf).empty())
      << fmt::format("{}", fmt::join(architecture_differences(catalog, hf), "; "));
  EXPECT_EQ(hf.total_params(), 15706484224);  // transformers' count (test_model_deepseek.cpp)
  json v3 = json::parse(R"({
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": true,
    "tie_word_embeddings": false, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.46.3", "use_cache": true, "v_head_dim": 128, "vocab_size": 129280
  })");
  hf = model_config_from_hf(v3, "config.json");
  catalog = load_experiment("", {{"model.name", "deepseek-v3"}}).model;
  EXPECT_TRUE(architecture_differences(catalog, hf).empty())
      << fmt::format("{}", fmt::join(architecture_differences(catalog, hf), "; "));
  EXPECT_EQ(hf_weight_layout(v3, "config.json").extra_layers, 1);
  v3["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"}};
  expect_error(v3, "\"quantization_config\" is set (a quantized checkpoint, such as DeepSeek-V3's FP8 weights); "
                   "forge reads unquantized F32, BF16, F16 or F64 weights");
}

TEST(HfImportConfig, RejectsUnsupportedDeepseeksNamingFileAndKey) {
  auto v2 = [](const std::function<void(json&)>& edit) {
    json c = deepseek_v2_json();
    edit(c);
    return c;
  };
  auto v3 = [](const std::function<void(json&)>& edit) {
    json c = deepseek_v3_json();
    edit(c);
    return c;
  };
  expect_error(v2([](json& c) {
                 c["topk_method"] = "group_limited_greedy";
                 c["n_group"] = nullptr;
               }),
               "\"n_group\" is missing or null with topk_method \"group_limited_greedy\": expected a positive integer");
  expect_error(v2([](json& c) {
                 c["topk_method"] = "group_limited_greedy";
                 c["n_group"] = 8;
                 c.erase("topk_group");
               }),
               "\"topk_group\" is missing or null with topk_method \"group_limited_greedy\": expected a positive integer");
  expect_error(v2([](json& c) { c["topk_method"] = "noaux_tc"; }), "\"topk_method\" is 'noaux_tc'");
  expect_error(v2([](json& c) { c["n_group"] = 8; }),
               "\"n_group\" is 8 with topk_method \"greedy\", which does not limit the experts to groups: expected 1 "
               "or null");
  expect_error(v2([](json& c) { c["norm_topk_prob"] = true; }),
               "\"norm_topk_prob\" is true; DeepseekV2ForCausalLM never renormalizes the top-k weights");
  expect_error(v2([](json& c) { c["scoring_func"] = "sigmoid"; }),
               "\"scoring_func\" is 'sigmoid'; DeepseekV2ForCausalLM routes on softmax scores (expected \"softmax\")");
  expect_error(v2([](json& c) { c["moe_layer_freq"] = 2; }), "\"moe_layer_freq\" is 2;");
  expect_error(v2([](json& c) { c["num_key_value_heads"] = 1; }),
               "\"num_key_value_heads\" is 1; Multi-head Latent Attention gives each of the 2 heads");
  expect_error(v2([](json& c) { c["attention_bias"] = true; }), "\"attention_bias\" is true");
  expect_error(v2([](json& c) { c["mlp_bias"] = true; }), "\"mlp_bias\" is true");
  expect_error(v2([](json& c) { c["hidden_act"] = "gelu"; }), "\"hidden_act\" is 'gelu'");
  expect_error(v2([](json& c) { c["n_shared_experts"] = -1; }), "\"n_shared_experts\" is -1, expected an integer >= 0");
  expect_error(v2([](json& c) { c["rope_scaling"]["type"] = "llama3"; }),
               "\"rope_scaling.rope_type\" is 'llama3'; forge supports \"default\" and \"yarn\" for DeepSeek models");
  expect_error(v2([](json& c) { c["rope_scaling"].erase("factor"); }),
               "\"rope_scaling.factor\" is missing (required by rope_type yarn)");
  expect_error(v2([](json& c) { c["rope_scaling"]["factor"] = 0.5; }), "\"rope_scaling.factor\" is 0.5; YaRN extends");
  expect_error(v2([](json& c) { c["rope_scaling"]["beta_slow"] = 40; }),
               "\"rope_scaling.beta_fast\" (32) must be greater than \"rope_scaling.beta_slow\" (40)");
  expect_error(v2([](json& c) { c["rope_scaling"]["attention_factor"] = 1.5; }),
               "\"rope_scaling.attention_factor\" is 1.5; forge scales cos/sin by the factor YaRN derives from factor, "
               "mscale and mscale_all_dim, 1");
  // truncate false: the ramp's bounds (here 0.49 and 2.47 of the 4 rotary dims) unrounded.
  expect_error(v2([](json& c) { c["rope_scaling"]["truncate"] = false; }),
               "\"rope_scaling.truncate\" is false: YaRN's ramp would run from dimension");
  expect_error(v2([](json& c) { c["rope_scaling"]["partial_rotary_factor"] = 0.5; }), "partial_rotary_factor");
  expect_error(v3([](json& c) { c["scoring_func"] = "softmax"; }),
               "\"scoring_func\" is 'softmax'; DeepseekV3ForCausalLM routes on sigmoid scores (expected \"sigmoid\")");
  expect_error(v3([](json& c) { c["topk_method"] = "greedy"; }), "\"topk_method\" is 'greedy';");
  expect_error(v3([](json& c) { c["n_group"] = 3; }), "model.router_num_groups (3) must divide model.num_experts (8)");
  expect_error(v3([](json& c) { c["rope_interleave"] = "yes"; }), "\"rope_interleave\" is \"yes\", expected true or false");
  json c = deepseek_v3_json();
  c["num_nextn_predict_layers"] = -1;
  EXPECT_NE(error_of([&] { hf_weight_layout(c, "config.json"); }).find("\"num_nextn_predict_layers\" is -1"),
            std::string::npos);
}

TEST(HfImportConfig, ADeepseekWhoseBlocksAreAllDenseIsADenseModel) {
  json c = deepseek_v2_json();
  c["first_k_dense_replace"] = 3;
  c["topk_method"] = "group_limited_greedy";  // never read: no block routes
  const ModelConfig m = model_config_from_hf(c, "config.json");
  EXPECT_FALSE(m.moe());
  EXPECT_EQ(m.first_dense_layers, 0);
  EXPECT_TRUE(m.mla());
  const json written = json::parse(hf_config_from_model(m, "float32").dump());
  EXPECT_EQ(written["architectures"], json::array({"DeepseekV2ForCausalLM"}));
  EXPECT_EQ(written["first_k_dense_replace"], 3);
  EXPECT_FALSE(written.contains("n_routed_experts"));
  EXPECT_TRUE(architecture_differences(m, model_config_from_hf(written, "config.json")).empty());
}

TEST(HfImportConfig, ExportedDeepseekConfigReadsBackAsTheSameModel) {
  for (bool v3 : {false, true}) {
    ModelConfig m = tiny_deepseek(v3);
    json written = json::parse(hf_config_from_model(m, "bfloat16").dump());
    EXPECT_EQ(written["architectures"], json::array({v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"}));
    EXPECT_EQ(written["model_type"], v3 ? "deepseek_v3" : "deepseek_v2");
    EXPECT_EQ(written["q_lora_rank"], v3 ? json(12) : json(nullptr));
    EXPECT_EQ(written["num_key_value_heads"], 2);
    EXPECT_EQ(written["head_dim"], 4);  // transformers writes qk_rope_head_dim there
    EXPECT_EQ(written["qk_head_dim"], 8);
    EXPECT_EQ(written["rope_parameters"]["rope_type"], "yarn");
    EXPECT_EQ(written["rope_scaling"]["type"], "yarn");
    EXPECT_EQ(written["rope_scaling"]["mscale_all_dim"], v3 ? 0.8 : 0.707);
    EXPECT_EQ(written["topk_method"], v3 ? "noaux_tc" : "greedy");
    EXPECT_EQ(written["scoring_func"], v3 ? "sigmoid" : "softmax");
    EXPECT_EQ(written["norm_topk_prob"], v3);
    EXPECT_EQ(written["moe_layer_freq"], 1);
    EXPECT_EQ(written.contains("rope_interleave"), v3);
    EXPECT_EQ(written.contains("num_nextn_predict_layers"), v3);
    if (v3) EXPECT_EQ(written["num_nextn_predict_layers"], 0);
    EXPECT_EQ(written.contains("mlp_bias"), !v3);
    EXPECT_FALSE(written.contains("sliding_window"));
    ModelConfig back = model_config_from_hf(written, "config.json");
    EXPECT_TRUE(architecture_differences(m, back).empty())
        << fmt::format("{}", fmt::join(architecture_differences(m, back), "; "));
    // Without rope scaling and with a compressed query.
    m.rope_scaling = {};
    m.q_lora_rank = 5;
    written = json::parse(hf_config_from_model(m, "float32").dump());
    EXPECT_TRUE(written["rope_scaling"].is_null());
    EXPECT_TRUE(architecture_differences(m, model_config_from_hf(written, "config.json")).empty());
  }
  HfWeightLayout rotate_half;
  rotate_half.interleaved_rotary = false;
  EXPECT_EQ(json::parse(hf_config_from_model(tiny_deepseek(true), "float32", "", rotate_half).dump())["rope_interleave"],
            false);
  std::string e = error_of([] { hf_config_from_model(tiny_deepseek(true), "float32", "mixtral"); });
  EXPECT_NE(e.find("a model with Multi-head Latent Attention cannot be written as a mixtral model"), std::string::npos)
      << e;
}

TEST(HfImportConfig, RefusesToWriteModelsNoHuggingFaceClassComputes) {
  auto refusal = [](const std::function<void(ModelConfig&)>& edit, bool mla) {
    ModelConfig m = mla ? tiny_deepseek(false) : tiny_mixtral();
    edit(m);
    return error_of([&] { hf_config_from_model(m, "float32"); });
  };
  std::string e = refusal([](ModelConfig& m) { m.num_shared_experts = 1; }, false);
  EXPECT_NE(e.find("cannot write the model as Hugging Face: model.num_shared_experts is 1; forge writes Llama, "
                   "Mistral and Mixtral models"),
            std::string::npos)
      << e;
  e = refusal([](ModelConfig& m) { m.first_dense_layers = 1; }, false);
  EXPECT_NE(e.find("model.first_dense_layers is 1"), std::string::npos) << e;
  e = refusal([](ModelConfig& m) { m.router_score_function = "sigmoid"; }, false);
  EXPECT_NE(e.find("model.router_score_function is sigmoid"), std::string::npos) << e;
  e = refusal([](ModelConfig& m) { m.router_normalize_topk = false; }, false);
  EXPECT_NE(e.find("model.router_normalize_topk is false"), std::string::npos) << e;
  e = refusal([](ModelConfig& m) { m.moe_ffn_hidden_size = 5; }, false);
  EXPECT_NE(e.find("model.moe_ffn_hidden_size is 5, not model.ffn_hidden_size (12)"), std::string::npos) << e;
  e = refusal(
      [](ModelConfig& m) {
        m.num_experts = 0;
        m.num_experts_per_tok = 0;
        m.rope_scaling.enabled = true;
        m.rope_scaling.type = "yarn";
      },
      false);
  EXPECT_NE(e.find("YaRN RoPE (model.rope_scaling.type yarn) is DeepSeek's"), std::string::npos) << e;
  e = refusal([](ModelConfig& m) { m.router_normalize_topk = true; }, true);
  EXPECT_NE(e.find("cannot write the model as Hugging Face DeepseekV2ForCausalLM: its softmax routing renormalizes"),
            std::string::npos)
      << e;
  e = refusal([](ModelConfig& m) { m.rope_scaling.type = "llama3"; }, true);
  EXPECT_NE(e.find("forge writes DeepSeek models with default or YaRN RoPE"), std::string::npos) << e;
  // A plain Mixtral and a top-1 softmax DeepSeek (renormalizing one weight changes nothing)
  // are written.
  hf_config_from_model(tiny_mixtral(), "float32");
  ModelConfig top1 = tiny_deepseek(false);
  top1.num_experts_per_tok = 1;
  top1.router_normalize_topk = true;
  hf_config_from_model(top1, "float32");
}

TEST(HfImportConfig, ArchitectureDifferencesNameDeepseeksKeys) {
  ModelConfig a = tiny_deepseek(true), b = tiny_deepseek(true);
  b.router_topk_groups = 1;
  b.q_lora_rank = 6;
  b.rope_scaling.mscale_all_dim = 1.0;
  EXPECT_EQ(architecture_differences(a, b),
            (std::vector<std::string>{"model.rope_scaling.mscale_all_dim: 0.8 here, 1 in config.json",
                                      "model.router_topk_groups: 2 here, 1 in config.json",
                                      "model.q_lora_rank: 12 here, 6 in config.json"}));
  const std::string overrides = model_overrides_for(a);
  for (const char* expected :
       {"--model.rope_scaling.type yarn", "--model.rope_scaling.beta_fast 32", "--model.num_shared_experts 1",
        "--model.router_score_function sigmoid", "--model.router_normalize_topk true",
        "--model.router_scaling_factor 2.5", "--model.kv_lora_rank 8", "--model.v_head_dim 6"})
    EXPECT_NE(overrides.find(expected), std::string::npos) << expected << " in " << overrides;
  // A Llama's overrides do not list the MoE and MLA keys it leaves at their defaults.
  EXPECT_EQ(model_overrides_for(tiny_model(false, 0)).find("router_score_function"), std::string::npos);
  EXPECT_EQ(model_overrides_for(tiny_model(false, 0)).find("qk_rope_head_dim"), std::string::npos);
}

// DeepSeek's rotary rows: in each query head's qk rows and in kv_a's last rows, the tensor's
// interleaved pairs are forge's halves (HfTensor::rotary_rows).
TEST(HfLayout, DeepseekRotaryRowsAreReorderedAndTheRoutingBiasKeptInFp32) {
  const ModelConfig m = tiny_deepseek(true);  // 2 heads of 4 + 4, kv rank 8, q rank 12
  std::map<std::string, std::vector<HfPart>> parts;
  for (const ParamSpec& spec : parameter_specs(m))
    if (spec.layer == 1) parts[spec.name] = hf_parts(spec);
  const HfPart& q_b = parts.at("layers.1.attention.q_b.weight").at(0);
  EXPECT_EQ(q_b.name, "model.layers.1.self_attn.q_b_proj.weight");
  EXPECT_EQ(q_b.row_order, (std::vector<int64_t>{0, 1, 2, 3, 4, 6, 5, 7, 8, 9, 10, 11, 12, 14, 13, 15}));
  const HfPart& kv_a = parts.at("layers.1.attention.kv_a.weight").at(0);
  EXPECT_EQ(kv_a.name, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight");
  EXPECT_EQ(kv_a.row_order, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 9, 11}));
  EXPECT_TRUE(parts.at("layers.1.attention.kv_b.weight").at(0).row_order.empty());
  EXPECT_TRUE(parts.at("layers.1.attention.q_a.weight").at(0).row_order.empty());
  const HfPart& bias = parts.at("layers.1.moe.router.bias").at(0);
  EXPECT_EQ(bias.name, "model.layers.1.mlp.gate.e_score_correction_bias");
  EXPECT_TRUE(bias.keep_fp32);
  EXPECT_FALSE(parts.at("layers.1.moe.router.weight").at(0).keep_fp32);
  const auto& gate_up = parts.at("layers.1.moe.experts.gate_up");
  EXPECT_EQ(gate_up[2].name, "model.layers.1.mlp.experts.1.gate_proj.weight");
  EXPECT_EQ(gate_up[3].name, "model.layers.1.mlp.experts.1.up_proj.weight");
  EXPECT_EQ(parts.at("layers.1.moe.shared.gate_up.weight").at(1).name,
            "model.layers.1.mlp.shared_experts.up_proj.weight");
  // rope_interleave false: no reordering.
  for (const ParamSpec& spec : parameter_specs(m))
    for (const HfPart& part : hf_parts(spec, false)) EXPECT_TRUE(part.row_order.empty()) << part.name;
  // Empty shared experts, in every MoE block, only without shared experts.
  EXPECT_TRUE(hf_empty_parts(m).empty());
  ModelConfig unshared = m;
  unshared.num_shared_experts = 0;
  const std::vector<HfPart> empty = hf_empty_parts(unshared);
  ASSERT_EQ(empty.size(), 6u);  // blocks 1 and 2
  EXPECT_EQ(empty[0].name, "model.layers.1.mlp.shared_experts.gate_proj.weight");
  EXPECT_EQ(empty[0].shape, (Shape{0, 16}));
  EXPECT_EQ(empty[5].name, "model.layers.2.mlp.shared_experts.down_proj.weight");
  EXPECT_EQ(empty[5].shape, (Shape{16, 0}));
  EXPECT_TRUE(hf_empty_parts(tiny_mixtral()).empty());
}

TEST(HfImportWeights, DeepseekExportImportRoundTripIsExact) {
  for (bool v3 : {false, true})
    for (int64_t shared : {0, 2}) {
      TempDir dir;
      ModelConfig config = tiny_deepseek(v3);
      config.num_shared_experts = shared;
      FlatParameters params(config);
      fill_pattern(params);
      for (SafetensorsDType dtype : {SafetensorsDType::F32, SafetensorsDType::BF16}) {
        const std::string out = dir.file(std::string("out-") + std::string(safetensors_dtype_name(dtype)));
        HfExportOptions options;
        options.dtype = dtype;
        save_hf_model(out, params, options);
        SafetensorsFile file(out + "/model.safetensors");
        // Rows of the file: the interleaved pairs of forge's halves.
        const SafetensorsEntry* kv_a = file.find("model.layers.0.self_attn.kv_a_proj_with_mqa.weight");
        ASSERT_NE(kv_a, nullptr);
        std::vector<float> rows(static_cast<size_t>(kv_a->numel()));
        file.read_as_float(*kv_a, rows.data());
        const float* forge_rows = params.find("layers.0.attention.kv_a.weight").data<float>();
        for (int64_t c = 0; c < 16; ++c) {
          EXPECT_EQ(rows[static_cast<size_t>(9 * 16 + c)], round_to(dtype, forge_rows[10 * 16 + c]));  // row 9 is forge's 10
          EXPECT_EQ(rows[static_cast<size_t>(10 * 16 + c)], round_to(dtype, forge_rows[9 * 16 + c]));
        }
        size_t empty = 0;
        for (const auto& e : file.entries()) {
          const bool bias = e.name.ends_with("e_score_correction_bias");
          EXPECT_EQ(e.dtype, bias ? SafetensorsDType::F32 : dtype) << e.name;  // the bias in fp32 always
          empty += e.numel() == 0;
        }
        EXPECT_EQ(empty, shared == 0 ? 6u : 0u);  // transformers' empty shared experts of blocks 1 and 2
        HfModel model = load_hf_model(out);
        EXPECT_TRUE(architecture_differences(config, model.config).empty());
        if (dtype == SafetensorsDType::F32) expect_same_weights(params, *model.params);
        if (v3)
          for (int layer : {1, 2}) {
            const std::string bias = fmt::format("layers.{}.moe.router.bias", layer);
            EXPECT_EQ(0, std::memcmp(params.find(bias).raw(), model.params->find(bias).raw(),
                                     params.find(bias).nbytes()));
          }
        // The export of the import is the same file.
        const std::string again = out + "-again";
        HfExportOptions from_source = options;
        from_source.source_dir = out;
        save_hf_model(again, *model.params, from_source);
        EXPECT_EQ(read_file_bytes(out + "/model.safetensors"), read_file_bytes(again + "/model.safetensors"));
      }
    }
}

// V3's rope_interleave false: the rows are rotate-half already, neither import nor export
// reorders them, and the export says so again.
TEST(HfImportWeights, DeepseekV3RopeNotInterleavedKeepsTheRows) {
  TempDir dir;
  FlatParameters params(tiny_deepseek(true));
  fill_pattern(params);
  const std::string source = dir.file("source");
  std::filesystem::create_directories(source);
  json config = deepseek_v3_json();
  config["rope_interleave"] = false;
  std::ofstream(source + "/config.json") << config.dump();
  HfExportOptions options;
  options.source_dir = source;
  save_hf_model(dir.file("out"), params, options);
  EXPECT_EQ(json::parse(std::ifstream(dir.file("out/config.json")))["rope_interleave"], false);
  SafetensorsFile file(dir.file("out/model.safetensors"));
  const SafetensorsEntry* q_b = file.find("model.layers.2.self_attn.q_b_proj.weight");
  ASSERT_NE(q_b, nullptr);
  std::vector<float> rows(static_cast<size_t>(q_b->numel()));
  file.read_as_float(*q_b, rows.data());
  const Tensor& mine = params.find("layers.2.attention.q_b.weight");
  EXPECT_EQ(0, std::memcmp(rows.data(), mine.raw(), mine.nbytes()));
  expect_same_weights(params, *load_hf_model(dir.file("out")).params);
}

// transformers 5's save_pretrained(save_original_format=False): the experts' whole stacks.
TEST(HfImportWeights, DeepseekFromTransformers5InMemoryNames) {
  TempDir dir;
  FlatParameters params(tiny_deepseek(true));
  fill_pattern(params);
  const std::string out = dir.file("out");
  save_hf_model(out, params);
  rewrite_weights(out, [&](std::vector<SafetensorsTensorRef>& refs) {
    std::erase_if(refs, [](const auto& r) { return r.name.find(".mlp.experts.") != std::string::npos; });
    for (int layer : {1, 2}) {
      const std::string hf = fmt::format("model.layers.{}.mlp.experts.", layer), p = fmt::format("layers.{}.moe.", layer);
      refs.push_back({hf + "gate_up_proj", {8, 16, 16}, params.find(p + "experts.gate_up").data<float>()});
      refs.push_back({hf + "down_proj", {8, 16, 8}, params.find(p + "experts.down").data<float>()});
    }
  });
  expect_same_weights(params, *load_hf_model(out).params);
}

class HfImportBadDeepseek : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig config = tiny_deepseek(true);
    config.num_shared_experts = 0;
    params_ = std::make_unique<FlatParameters>(config);
    fill_pattern(*params_);
    out_ = dir_.file("out");
    save_hf_model(out_, *params_);
  }
  std::string import_error() { return error_of([&] { load_hf_model(out_); }); }
  void set_config(const std::function<void(json&)>& edit) {
    json config = json::parse(std::ifstream(out_ + "/config.json"));
    edit(config);
    std::ofstream(out_ + "/config.json") << config.dump();
  }

  TempDir dir_;
  std::unique_ptr<FlatParameters> params_;
  std::string out_;
};

TEST_F(HfImportBadDeepseek, MisshapenAndMissingTensorsAreNamed) {
  std::vector<float> big(14 * 16);
  rewrite_weights(out_, [&](auto& refs) {
    for (auto& r : refs)
      if (r.name == "model.layers.0.self_attn.kv_a_proj_with_mqa.weight") r = {r.name, {14, 16}, big.data()};
  });
  std::string e = import_error();
  EXPECT_NE(e.find(out_ + "/model.safetensors: tensor 'model.layers.0.self_attn.kv_a_proj_with_mqa.weight' has shape "
                          "[14, 16], but the model's architecture needs [12, 16]"),
            std::string::npos)
      << e;
  save_hf_model(dir_.file("fresh"), *params_);
  out_ = dir_.file("fresh");
  rewrite_weights(out_, [](auto& refs) {
    std::erase_if(refs, [](const auto& r) { return r.name == "model.layers.2.mlp.gate.e_score_correction_bias"; });
  });
  e = import_error();
  EXPECT_NE(e.find(out_ + ": no tensor 'model.layers.2.mlp.gate.e_score_correction_bias' in the weight files (expected "
                          "[8] for forge's 'layers.2.moe.router.bias')"),
            std::string::npos)
      << e;
}

TEST_F(HfImportBadDeepseek, SharedExpertsMustBeEmptyWithoutThem) {
  // The empty ones transformers writes are accepted (SetUp's export has them); a real one is not.
  expect_same_weights(*params_, *load_hf_model(out_).params);
  std::vector<float> weights(8 * 16);
  rewrite_weights(out_, [&](auto& refs) {
    for (auto& r : refs)
      if (r.name == "model.layers.1.mlp.shared_experts.up_proj.weight") r = {r.name, {8, 16}, weights.data()};
  });
  const std::string e = import_error();
  EXPECT_NE(e.find("1 tensor(s) that a DeepSeek-V3 model does not have: model.layers.1.mlp.shared_experts.up_proj.weight"),
            std::string::npos)
      << e;
}

TEST_F(HfImportBadDeepseek, MultiTokenPredictionBlocksAreNotRead) {
  // DeepSeek-V3's num_nextn_predict_layers blocks come after the last: not read, while
  // config.json has them; anything else after the last block is refused.
  std::vector<float> extra(16 * 16);
  rewrite_weights(out_, [&](auto& refs) {
    refs.push_back({"model.layers.3.eh_proj.weight", {16, 16}, extra.data()});
    refs.push_back({"model.layers.3.self_attn.o_proj.weight", {16, 12}, extra.data()});
  });
  set_config([](json& c) { c["num_nextn_predict_layers"] = 1; });
  expect_same_weights(*params_, *load_hf_model(out_).params);
  set_config([](json& c) { c["num_nextn_predict_layers"] = 0; });
  const std::string e = import_error();
  EXPECT_NE(e.find("2 tensor(s) that a DeepSeek-V3 model does not have: model.layers.3.eh_proj.weight"),
            std::string::npos)
      << e;
}

TEST_F(HfImportBadDeepseek, ExpertCountDisagreeingWithConfigIsRefused) {
  set_config([](json& c) { c["n_routed_experts"] = 4; c["n_group"] = 2; c["topk_group"] = 2; });
  std::string e = import_error();
  EXPECT_NE(e.find("tensor 'model.layers.1.mlp.gate.weight' has shape [8, 16], but the model's architecture needs "
                   "[4, 16]"),
            std::string::npos)
      << e;
}

}  // namespace
}  // namespace forge
