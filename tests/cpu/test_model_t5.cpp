// The T5 encoder's pieces on the CPU: the preset and config.json reading
// (transformers' defaults, refusals naming the file and key), the relative
// position buckets (values transformers gives) and the position bias layout,
// loading weights from safetensors (every tensor exactly, either name of the
// tied embedding, refusals of missing, extra and misshapen tensors naming the
// file and tensor), and the forward's own invariants (a batch equals its
// captions one by one; the output rows are RMS-normalized; bad token ids are
// refused). The forward's values are checked against transformers in
// tests/python/test_t5_encoder_vs_transformers.py.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "ckpt/t5_weights.h"
#include "expect_error.h"
#include "file_testing.h"
#include "model/t5_encoder.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using nlohmann::json;

T5Config tiny_config() {
  T5Config c;
  c.name = "tiny";
  c.vocab_size = 11;
  c.d_model = 8;
  c.d_kv = 4;
  c.num_heads = 3;
  c.d_ff = 12;
  c.num_layers = 2;
  c.relative_attention_num_buckets = 8;
  c.relative_attention_max_distance = 6;
  return c;
}

json config_json(const T5Config& c) {
  return {{"model_type", "t5"},
          {"vocab_size", c.vocab_size},
          {"d_model", c.d_model},
          {"d_kv", c.d_kv},
          {"num_heads", c.num_heads},
          {"d_ff", c.d_ff},
          {"num_layers", c.num_layers},
          {"relative_attention_num_buckets", c.relative_attention_num_buckets},
          {"relative_attention_max_distance", c.relative_attention_max_distance},
          {"layer_norm_epsilon", c.layer_norm_epsilon},
          {"feed_forward_proj", "gated-gelu"},
          {"is_gated_act", true},
          {"dense_act_fn", "gelu_new"}};
}

// A transformers-style folder in `dir`: config.json and model.safetensors
// holding `weights`' tensors, renamed or changed by `edit` first.
void write_folder(const TempDir& dir, const T5Weights& weights,
                  const std::function<void(std::vector<SafetensorsTensorRef>&)>& edit = {}) {
  testing::write_file(dir.file("config.json"), config_json(weights.config()).dump());
  std::vector<SafetensorsTensorRef> refs;
  for (size_t i = 0; i < weights.specs().size(); ++i)
    refs.push_back({weights.specs()[i].name, weights.specs()[i].shape, weights.tensors()[i].data<float>()});
  if (edit) edit(refs);
  write_safetensors(dir.file("model.safetensors"), refs, SafetensorsDType::F32, {{"format", "pt"}});
}

TEST(T5Config, PresetIsT5V11Xxl) {
  const T5Config c = t5_v1_1_xxl_config();
  EXPECT_EQ(c.d_model, 4096);
  EXPECT_EQ(c.inner_dim(), 4096);
  EXPECT_EQ(c.d_ff, 10240);
  EXPECT_EQ(c.num_layers, 24);
  EXPECT_EQ(c.vocab_size, 32128);
  EXPECT_EQ(c.parameter_count(),
            4'762'310'656);  // T5EncoderModel(google/t5-v1_1-xxl)'s parameters
  EXPECT_EQ(t5_tensor_specs(c).size(), 1 + 24 * 9 + 1 + 1u);
}

TEST(T5Config, ReadsConfigJsonWithTransformersDefaults) {
  TempDir dir;
  testing::write_file(dir.file("config.json"), R"({"feed_forward_proj": "gated-gelu", "num_heads": 2})");
  const T5Config c = read_t5_config(dir.file("config.json"));
  EXPECT_EQ(c.d_model, 512);
  EXPECT_EQ(c.d_kv, 64);
  EXPECT_EQ(c.num_heads, 2);
  EXPECT_EQ(c.d_ff, 2048);
  EXPECT_EQ(c.num_layers, 6);
  EXPECT_EQ(c.vocab_size, 32128);
  EXPECT_EQ(c.relative_attention_num_buckets, 32);
  EXPECT_EQ(c.relative_attention_max_distance, 128);
  EXPECT_DOUBLE_EQ(c.layer_norm_epsilon, 1e-6);
}

TEST(T5Config, RefusesWhatForgeDoesNotCompute) {
  TempDir dir;
  const std::string path = dir.file("config.json");
  const std::vector<std::pair<json, std::string>> cases = {
      {json::object(), "\"feed_forward_proj\" is \"relu\""},  // transformers' default: the
                                                              // original T5
      {{{"feed_forward_proj", "gated-silu"}}, "\"feed_forward_proj\" is \"gated-silu\""},
      {{{"feed_forward_proj", "gated-gelu"}, {"is_gated_act", false}}, "\"is_gated_act\" is false"},
      {{{"feed_forward_proj", "gated-gelu"}, {"dense_act_fn", "gelu"}}, "\"dense_act_fn\" is \"gelu\""},
      {{{"feed_forward_proj", "gated-gelu"}, {"model_type", "umt5"}}, "\"model_type\" is \"umt5\""},
      {{{"feed_forward_proj", "gated-gelu"}, {"d_kv", -1}}, "\"d_kv\" is -1"},
      {{{"feed_forward_proj", "gated-gelu"}, {"num_layers", 2.5}}, "\"num_layers\" is 2.5"},
      {{{"feed_forward_proj", "gated-gelu"}, {"layer_norm_epsilon", 0}}, "\"layer_norm_epsilon\" is 0"},
      {{{"feed_forward_proj", "gated-gelu"}, {"relative_attention_num_buckets", 3}},
       "relative_attention_num_buckets must be at least 4"},
      {{{"feed_forward_proj", "gated-gelu"}, {"relative_attention_max_distance", 8}},
       "relative_attention_max_distance must exceed the 8 exact buckets"},
      {json::array(), "expected a JSON object"},
  };
  for (const auto& [config, message] : cases) {
    testing::write_file(path, config.dump());
    expect_error([&] { read_t5_config(path); }, {path, message});
  }
  expect_error([&] { read_t5_config(dir.file("missing.json")); }, {"missing.json"});
}

TEST(T5Encoder, RelativePositionBucketsAreTransformers) {
  // T5Attention._relative_position_bucket(r, bidirectional=True,
  // num_buckets=32, max_distance=128).
  const std::vector<std::pair<int64_t, int64_t>> expected = {
      {-200, 15}, {-128, 15}, {-127, 15}, {-64, 14}, {-63, 13}, {-32, 12}, {-16, 10}, {-15, 9},  {-12, 9},
      {-8, 8},    {-7, 7},    {-1, 1},    {0, 0},    {1, 17},   {7, 23},   {8, 24},   {11, 24},  {12, 25},
      {15, 25},   {16, 26},   {31, 27},   {32, 28},  {63, 29},  {64, 30},  {127, 31}, {128, 31}, {500, 31}};
  for (const auto& [relative, bucket] : expected)
    EXPECT_EQ(t5_relative_position_bucket(relative, 32, 128), bucket) << relative;
}

TEST(T5Encoder, PositionBiasLooksUpEachPairsBucket) {
  const T5Config c = tiny_config();
  Tensor table = Tensor::empty({c.relative_attention_num_buckets, c.num_heads});
  for (int64_t i = 0; i < table.numel(); ++i) table.data<float>()[i] = static_cast<float>(i);
  const int64_t length = 9;
  const Tensor bias = t5_position_bias(c, table, length);
  ASSERT_EQ(bias.shape(), (Shape{c.num_heads, length, length}));
  for (int64_t h = 0; h < c.num_heads; ++h)
    for (int64_t i = 0; i < length; ++i)
      for (int64_t j = 0; j < length; ++j)
        EXPECT_EQ(bias.data<float>()[(h * length + i) * length + j],
                  static_cast<float>(t5_relative_position_bucket(j - i, 8, 6) * c.num_heads + h));
}

TEST(T5Weights, LoadsEveryTensorExactly) {
  TempDir dir;
  T5Weights source(tiny_config());
  source.initialize(7);
  write_folder(dir, source);
  const std::string folder = std::filesystem::path(dir.file("x")).parent_path().string();
  const T5Weights loaded = load_t5_encoder(folder);
  ASSERT_EQ(loaded.tensors().size(), source.tensors().size());
  for (size_t i = 0; i < source.tensors().size(); ++i)
    for (int64_t j = 0; j < source.tensors()[i].numel(); ++j)
      ASSERT_EQ(loaded.tensors()[i].data<float>()[j], source.tensors()[i].data<float>()[j]) << source.specs()[i].name;

  // The tied embedding under transformers' other name, alone or beside
  // shared.weight (then shared.weight is read).
  write_folder(dir, source, [](auto& refs) { refs.front().name = "encoder.embed_tokens.weight"; });
  EXPECT_EQ(load_t5_encoder(folder).embedding().data<float>()[5], source.embedding().data<float>()[5]);
  const std::vector<float> zeros(static_cast<size_t>(source.embedding().numel()), 0.0f);
  write_folder(dir, source, [&](auto& refs) {
    refs.push_back({"encoder.embed_tokens.weight", source.specs().front().shape, zeros.data()});
  });
  EXPECT_EQ(load_t5_encoder(folder).embedding().data<float>()[5], source.embedding().data<float>()[5]);
}

TEST(T5Weights, RefusesMissingExtraAndMisshapenTensors) {
  TempDir dir;
  T5Weights source(tiny_config());
  source.initialize(1);
  const std::string folder = std::filesystem::path(dir.file("x")).parent_path().string();
  const std::string file = dir.file("model.safetensors");
  const std::vector<float> values(1000, 0.5f);

  write_folder(dir, source, [](auto& refs) {
    std::erase_if(refs, [](const auto& r) { return r.name == "encoder.block.1.layer.1.DenseReluDense.wi_1.weight"; });
  });
  expect_error([&] { load_t5_encoder(folder); },
               {folder, "no tensor 'encoder.block.1.layer.1.DenseReluDense.wi_1.weight'"});

  write_folder(dir, source, [&](auto& refs) {
    refs.push_back({"decoder.final_layer_norm.weight", {8}, values.data()});
  });
  expect_error([&] { load_t5_encoder(folder); }, {file, "tensor 'decoder.final_layer_norm.weight' has no place"});

  write_folder(dir, source, [&](auto& refs) {
    refs.push_back({"encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight", {8, 3}, values.data()});
  });
  expect_error([&] { load_t5_encoder(folder); }, {file,
                                                  "'encoder.block.1.layer.0.SelfAttention.relative_"
                                                  "attention_bias.weight' has no place"});

  write_folder(dir, source, [](auto& refs) { refs.back().shape = {4, 2}; });
  expect_error([&] { load_t5_encoder(folder); }, {file, "'encoder.final_layer_norm.weight' is [4, 2]", "needs [8]"});

  write_folder(dir, source, [&](auto& refs) {
    refs.push_back({"encoder.embed_tokens.weight", {10, 8}, values.data()});
  });
  expect_error([&] { load_t5_encoder(folder); }, {file, "'encoder.embed_tokens.weight' is [10, 8]"});

  write_folder(dir, source, [](auto& refs) { refs.erase(refs.begin()); });
  expect_error([&] { load_t5_encoder(folder); }, {folder, "no embedding"});

  expect_error([&] { load_t5_encoder(dir.file("nowhere")); }, {"nowhere", "not found"});
}

TEST(T5Encoder, BatchEqualsCaptionsOneByOne) {
  const T5Config c = tiny_config();
  T5Weights weights(c);
  weights.initialize(3);
  T5Encoder encoder(weights);
  const int64_t length = 13;  // beyond max_distance 6: shared far buckets
  Tensor tokens = Tensor::empty({2, length}, DType::I32);
  for (int64_t i = 0; i < tokens.numel(); ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 7 + 3) % 11);
  Tensor both = Tensor::empty({2, length, c.d_model});
  encoder.forward(tokens, both);
  for (int64_t b = 0; b < 2; ++b) {
    Tensor one = Tensor::empty({1, length, c.d_model});
    encoder.forward(tokens.narrow(b, b + 1), one);
    for (int64_t i = 0; i < one.numel(); ++i)
      EXPECT_NEAR(one.data<float>()[i], both.data<float>()[b * one.numel() + i], 1e-5) << "caption " << b;
  }
  // The final RMSNorm: each row divided by the final norm's scales has mean
  // square 1.
  const float* w = weights.final_norm().data<float>();
  for (int64_t row = 0; row < 2 * length; ++row) {
    double ms = 0.0;
    for (int64_t d = 0; d < c.d_model; ++d) {
      const double x = both.data<float>()[row * c.d_model + d] / w[d];
      ms += x * x / static_cast<double>(c.d_model);
    }
    EXPECT_NEAR(ms, 1.0, 1e-4) << row;
  }
}

TEST(T5Encoder, RefusesTokensOutsideTheVocabulary) {
  T5Weights weights(tiny_config());
  T5Encoder encoder(weights);
  Tensor tokens = Tensor::zeros({2, 4}, DType::I32);
  tokens.data<int32_t>()[6] = 11;
  Tensor out = Tensor::empty({2, 4, 8});
  expect_error([&] { encoder.forward(tokens, out); }, {"token id 11 at caption 1 position 2", "[0, 11)"});
  expect_error([&] { encoder.forward(tokens, Tensor::empty({2, 4, 7})); }, {"T5 encoder out"});
}

}  // namespace
}  // namespace forge
