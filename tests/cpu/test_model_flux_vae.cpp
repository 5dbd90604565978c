// The FLUX VAE model: presets and their published parameter count, diffusers config.json
// reading and every refusal of it, the parameter names and layouts, loading both weight
// layouts (and refusing missing, extra and misshapen tensors and a disagreeing config), the
// BFL names, and the model's interface (shapes it refuses, the mode against a sample with
// zero noise, the moments against the latents, activation buffers reused across calls).
// The numbers themselves are checked against diffusers in python.test_flux_vae_vs_diffusers.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/flux_vae_weights.h"
#include "ckpt/safetensors.h"
#include "expect_error.h"
#include "file_testing.h"
#include "model/flux_vae.h"
#include "ops_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// FLUX.1-dev's vae/config.json.
const char* kFluxDevConfig = R"({
  "_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0.dev0", "act_fn": "silu",
  "block_out_channels": [128, 256, 512, 512],
  "down_block_types": ["DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"],
  "force_upcast": true, "in_channels": 3, "latent_channels": 16, "latents_mean": null, "latents_std": null,
  "layers_per_block": 2, "mid_block_add_attention": true, "norm_num_groups": 32, "out_channels": 3,
  "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
  "up_block_types": ["UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"],
  "use_post_quant_conv": false, "use_quant_conv": false})";

FluxVaeConfig tiny_config() {
  FluxVaeConfig c;
  c.name = "tiny";
  c.block_out_channels = {8, 16};
  c.norm_num_groups = 4;
  c.latent_channels = 4;
  c.layers_per_block = 1;
  return c;
}

json diffusers_config(const FluxVaeConfig& c) {
  const std::vector<std::string> down(c.block_out_channels.size(), "DownEncoderBlock2D"),
      up(c.block_out_channels.size(), "UpDecoderBlock2D");
  return {{"_class_name", "AutoencoderKL"}, {"in_channels", c.in_channels}, {"out_channels", c.out_channels},
          {"latent_channels", c.latent_channels}, {"block_out_channels", c.block_out_channels},
          {"down_block_types", down}, {"up_block_types", up}, {"layers_per_block", c.layers_per_block},
          {"norm_num_groups", c.norm_num_groups}, {"act_fn", "silu"},
          {"mid_block_add_attention", c.mid_block_add_attention}, {"use_quant_conv", c.use_quant_conv},
          {"use_post_quant_conv", c.use_post_quant_conv}, {"scaling_factor", c.scaling_factor},
          {"shift_factor", c.shift_factor}};
}

struct FileTensor {
  Shape shape;
  std::vector<float> values;
};

// The parameters as a layout's file tensors (NOTE [FLUX VAE weight files]).
std::map<std::string, FileTensor> file_tensors(const FluxVaeParameters& p, FluxVaeWeightLayout layout) {
  std::map<std::string, FileTensor> files;
  for (size_t i = 0; i < p.specs().size(); ++i) {
    const FluxVaeParamSpec& spec = p.specs()[i];
    const float* src = p.tensors()[i].data<float>();
    const int64_t row = p.tensors()[i].numel() / spec.shape[0];
    int64_t first = 0;
    for (const FluxVaeFileTensor& t : spec.files) {
      std::string name = t.name;
      Shape shape = spec.file_shape(t.rows);
      if (layout == FluxVaeWeightLayout::Bfl) {
        name = flux_vae_bfl_name(t.name, p.config().levels());
        if (name.find(".attn_1.") != std::string::npos && shape.size() == 2) shape = {shape[0], shape[1], 1, 1};
      }
      std::vector<float> values(static_cast<size_t>(t.rows * row));
      if (spec.conv) {  // [O, K, K, I] -> [O, I, K, K]
        const int64_t k = spec.shape[1], in = spec.shape[3];
        for (int64_t o = 0; o < t.rows; ++o)
          for (int64_t c = 0; c < in; ++c)
            for (int64_t y = 0; y < k; ++y)
              for (int64_t x = 0; x < k; ++x)
                values[static_cast<size_t>(((o * in + c) * k + y) * k + x)] =
                    src[(((first + o) * k + y) * k + x) * in + c];
      } else {
        std::copy_n(src + first * row, t.rows * row, values.begin());
      }
      files[name] = {shape, std::move(values)};
      first += t.rows;
    }
  }
  return files;
}

void write_tensors(const std::string& path, const std::map<std::string, FileTensor>& tensors) {
  std::vector<SafetensorsTensorRef> refs;
  for (const auto& [name, t] : tensors) refs.push_back({name, t.shape, t.values.data()});
  write_safetensors(path, refs, SafetensorsDType::F32, {{"format", "pt"}});
}

// A diffusers VAE folder (config.json and the weights) at dir.
void write_diffusers_folder(const std::string& dir, const FluxVaeParameters& p,
                            const std::map<std::string, FileTensor>& tensors) {
  fs::create_directories(dir);
  testing::write_file(dir + "/config.json", diffusers_config(p.config()).dump());
  write_tensors(dir + "/diffusion_pytorch_model.safetensors", tensors);
}

std::vector<double> values_of(const FluxVaeParameters& p) {
  std::vector<double> all;
  for (const Tensor& t : p.tensors())
    for (double v : testing::to_double(t)) all.push_back(v);
  return all;
}

TEST(FluxVaeConfig, PresetsAndTheirParameterCounts) {
  const FluxVaeConfig flux = flux_vae_preset("flux1-vae");
  EXPECT_EQ(flux.checked_total_params(), 83'819'683);  // diffusers' count of FLUX.1-dev's VAE
  EXPECT_EQ(flux.downsample_factor(), 8);
  EXPECT_FLOAT_EQ(flux.scaling_factor, 0.3611f);
  EXPECT_FLOAT_EQ(flux.shift_factor, 0.1159f);
  for (const std::string& name : flux_vae_preset_names()) {
    const FluxVaeConfig c = flux_vae_preset(name);
    int64_t total = 0;
    for (const FluxVaeParamSpec& s : flux_vae_parameter_specs(c)) total += shape_numel(s.shape);
    EXPECT_EQ(c.checked_total_params(), total) << name;
  }
  expect_error([] { flux_vae_preset("sd-vae"); }, {"sd-vae", "flux1-vae", "flux-vae-debug"});
}

TEST(FluxVaeConfig, ReadsFluxDevsConfigAndDiffusersDefaults) {
  const FluxVaeConfig dev = flux_vae_config_from_diffusers(json::parse(kFluxDevConfig), "vae/config.json");
  EXPECT_TRUE(dev.same_model(flux_vae_preset("flux1-vae")));
  const FluxVaeConfig defaults = flux_vae_config_from_diffusers(json::object(), "config.json");
  EXPECT_EQ(defaults.latent_channels, 4);
  EXPECT_EQ(defaults.block_out_channels, std::vector<int64_t>{64});
  EXPECT_EQ(defaults.layers_per_block, 1);
  EXPECT_TRUE(defaults.use_quant_conv && defaults.use_post_quant_conv);
  EXPECT_FLOAT_EQ(defaults.scaling_factor, 0.18215f);
  EXPECT_EQ(defaults.shift_factor, 0.0f);
  json null_shift = json::parse(kFluxDevConfig);
  null_shift["shift_factor"] = nullptr;
  EXPECT_EQ(flux_vae_config_from_diffusers(null_shift, "c.json").shift_factor, 0.0f);
}

TEST(FluxVaeConfig, RefusesWhatForgeWouldComputeDifferently) {
  auto refused = [](const std::string& key, const json& value, const std::vector<std::string>& fragments) {
    json j = json::parse(kFluxDevConfig);
    if (value.is_discarded())
      j.erase(key);
    else
      j[key] = value;
    std::vector<std::string> all = {"vae/config.json", key};
    all.insert(all.end(), fragments.begin(), fragments.end());
    expect_error([&] { flux_vae_config_from_diffusers(j, "vae/config.json"); }, all);
  };
  refused("_class_name", "AutoencoderKLFlux2", {"AutoencoderKL"});
  refused("act_fn", "gelu", {"silu"});
  refused("down_block_types", json::array({"DownEncoderBlock2D", "AttnDownEncoderBlock2D", "DownEncoderBlock2D",
                                            "DownEncoderBlock2D"}),
          {"AttnDownEncoderBlock2D"});
  refused("up_block_types", json::array({"UpDecoderBlock2D"}), {"1 blocks", "4 levels"});
  refused("latents_mean", json::array({0.1, 0.2}), {"null"});
  refused("norm_num_groups", 24, {"multiples"});
  refused("block_out_channels", json::array({128, -256}), {"positive integer"});
  refused("block_out_channels", json::array(), {"list"});
  refused("latent_channels", 2.5, {"positive integer"});
  refused("scaling_factor", "0.3611", {"number"});
  refused("scaling_factor", 0, {"positive"});
  refused("use_quant_conv", 1, {"true or false"});
  refused("tile_sample_min_size", 512, {"unknown key"});
  expect_error([] { flux_vae_config_from_diffusers(json::array(), "vae/config.json"); }, {"vae/config.json", "object"});
}

TEST(FluxVaeParameters, DiffusersNamesAndForgesLayouts) {
  FluxVaeConfig c = tiny_config();
  c.use_quant_conv = true;
  std::map<std::string, FluxVaeParamSpec> specs;
  for (const FluxVaeParamSpec& s : flux_vae_parameter_specs(c)) specs[s.name] = s;
  EXPECT_EQ(specs.at("encoder.conv_in.weight").shape, (Shape{8, 3, 3, 3}));
  EXPECT_TRUE(specs.at("encoder.conv_in.weight").conv);
  EXPECT_EQ(specs.at("encoder.conv_in.weight").file_shape(8), (Shape{8, 3, 3, 3}));
  EXPECT_EQ(specs.at("encoder.down_blocks.1.resnets.0.conv_shortcut.weight").shape, (Shape{16, 1, 1, 8}));
  EXPECT_EQ(specs.at("encoder.down_blocks.1.resnets.0.conv_shortcut.weight").file_shape(16), (Shape{16, 8, 1, 1}));
  EXPECT_TRUE(specs.contains("encoder.down_blocks.0.downsamplers.0.conv.bias"));
  EXPECT_FALSE(specs.contains("encoder.down_blocks.1.downsamplers.0.conv.bias"));  // none at the last level
  const FluxVaeParamSpec& qkv = specs.at("decoder.mid_block.attentions.0.to_qkv.weight");
  EXPECT_EQ(qkv.shape, (Shape{48, 16}));
  ASSERT_EQ(qkv.files.size(), 3u);
  EXPECT_EQ(qkv.files[1].name, "decoder.mid_block.attentions.0.to_k.weight");
  EXPECT_EQ(specs.at("quant_conv.weight").shape, (Shape{8, 1, 1, 8}));
  EXPECT_FALSE(specs.contains("post_quant_conv.weight"));
  // The decoder's up blocks run the channels reversed, each layers_per_block + 1 ResNets.
  EXPECT_EQ(specs.at("decoder.up_blocks.0.resnets.1.conv1.weight").shape, (Shape{16, 3, 3, 16}));
  EXPECT_EQ(specs.at("decoder.up_blocks.1.resnets.0.conv_shortcut.weight").shape, (Shape{8, 1, 1, 16}));
  EXPECT_TRUE(specs.contains("decoder.up_blocks.0.upsamplers.0.conv.weight"));
  EXPECT_FALSE(specs.contains("decoder.up_blocks.1.upsamplers.0.conv.weight"));
  EXPECT_EQ(specs.at("decoder.conv_out.weight").shape, (Shape{3, 3, 3, 8}));
  FluxVaeParameters params(c);
  expect_error([&] { params.get("encoder.conv_in.weights"); }, {"encoder.conv_in.weights"});
}

TEST(FluxVaeWeights, BflNamesAreDiffusersConvertersInverse) {
  const int64_t levels = 4;
  const std::map<std::string, std::string> names = {
      {"encoder.conv_in.weight", "encoder.conv_in.weight"},
      {"encoder.down_blocks.1.resnets.0.conv_shortcut.bias", "encoder.down.1.block.0.nin_shortcut.bias"},
      {"encoder.down_blocks.2.downsamplers.0.conv.weight", "encoder.down.2.downsample.conv.weight"},
      {"encoder.mid_block.resnets.1.norm2.weight", "encoder.mid.block_2.norm2.weight"},
      {"encoder.mid_block.attentions.0.group_norm.bias", "encoder.mid.attn_1.norm.bias"},
      {"decoder.mid_block.attentions.0.to_v.weight", "decoder.mid.attn_1.v.weight"},
      {"decoder.mid_block.attentions.0.to_out.0.bias", "decoder.mid.attn_1.proj_out.bias"},
      {"encoder.conv_norm_out.weight", "encoder.norm_out.weight"},
      {"decoder.up_blocks.0.resnets.2.conv1.weight", "decoder.up.3.block.2.conv1.weight"},
      {"decoder.up_blocks.2.upsamplers.0.conv.bias", "decoder.up.1.upsample.conv.bias"},
      {"decoder.up_blocks.3.resnets.0.conv_shortcut.weight", "decoder.up.0.block.0.nin_shortcut.weight"},
      {"post_quant_conv.weight", "post_quant_conv.weight"}};
  for (const auto& [diffusers, bfl] : names) EXPECT_EQ(flux_vae_bfl_name(diffusers, levels), bfl);
}

TEST(FluxVaeWeights, LoadsBothLayoutsExactly) {
  TempDir dir;
  FluxVaeConfig c = tiny_config();
  c.use_post_quant_conv = true;
  FluxVaeParameters params(c);
  params.initialize_random(3);
  // A pipeline folder: its vae/ subfolder is found.
  write_diffusers_folder(dir.file("pipeline/vae"), params, file_tensors(params, FluxVaeWeightLayout::Diffusers));
  EXPECT_EQ(flux_vae_weight_layout_of(dir.file("pipeline")), FluxVaeWeightLayout::Diffusers);
  EXPECT_TRUE(flux_vae_config_at(dir.file("pipeline")).same_model(c));
  FluxVaeParameters loaded(c);
  load_flux_vae_weights(dir.file("pipeline"), loaded);
  EXPECT_EQ(values_of(loaded), values_of(params));

  write_tensors(dir.file("ae.safetensors"), file_tensors(params, FluxVaeWeightLayout::Bfl));
  EXPECT_EQ(flux_vae_weight_layout_of(dir.file("ae.safetensors")), FluxVaeWeightLayout::Bfl);
  EXPECT_TRUE(flux_vae_config_at(dir.file("ae.safetensors")).same_model(flux_vae_preset("flux1-vae")));
  FluxVaeParameters from_bfl(c);
  load_flux_vae_weights(dir.file("ae.safetensors"), from_bfl);
  EXPECT_EQ(values_of(from_bfl), values_of(params));
  expect_error([&] { flux_vae_weight_layout_of(dir.file("missing.safetensors")); },
               {"missing.safetensors", "not found"});
}

TEST(FluxVaeWeights, RefusesMissingExtraAndMisshapenTensorsAndAnotherConfig) {
  TempDir dir;
  const FluxVaeConfig c = tiny_config();
  FluxVaeParameters params(c);
  params.initialize_random(4);
  const auto tensors = file_tensors(params, FluxVaeWeightLayout::Diffusers);
  FluxVaeParameters target(c);

  auto missing = tensors;
  missing.erase("decoder.mid_block.attentions.0.to_k.bias");
  write_diffusers_folder(dir.file("missing"), params, missing);
  expect_error([&] { load_flux_vae_weights(dir.file("missing"), target); },
               {"missing", "no tensor 'decoder.mid_block.attentions.0.to_k.bias'"});

  auto extra = tensors;
  extra["encoder.down_blocks.1.downsamplers.0.conv.bias"] = {{16}, std::vector<float>(16)};
  write_diffusers_folder(dir.file("extra"), params, extra);
  expect_error([&] { load_flux_vae_weights(dir.file("extra"), target); },
               {"diffusion_pytorch_model.safetensors", "'encoder.down_blocks.1.downsamplers.0.conv.bias'",
                "no place"});

  auto misshapen = tensors;
  misshapen["encoder.conv_out.weight"].shape = {8, 16, 9, 1};
  write_diffusers_folder(dir.file("misshapen"), params, misshapen);
  expect_error([&] { load_flux_vae_weights(dir.file("misshapen"), target); },
               {"'encoder.conv_out.weight' is [8, 16, 9, 1]", "[8, 16, 3, 3]"});

  write_diffusers_folder(dir.file("other"), params, tensors);
  json other = diffusers_config(c);
  other["scaling_factor"] = 0.5;
  testing::write_file(dir.file("other/config.json"), other.dump());
  expect_error([&] { load_flux_vae_weights(dir.file("other"), target); }, {"other/config.json", "another VAE"});

  fs::remove(dir.file("other/config.json"));
  expect_error([&] { load_flux_vae_weights(dir.file("other"), target); }, {"other", "no config.json"});

  // BFL's file holds FLUX's VAE; a file for another model (here the tiny one's) is refused.
  write_tensors(dir.file("ae.safetensors"), file_tensors(params, FluxVaeWeightLayout::Bfl));
  FluxVaeParameters flux(flux_vae_preset("flux1-vae"));
  expect_error([&] { load_flux_vae_weights(dir.file("ae.safetensors"), flux); }, {"ae.safetensors", "flux1-vae"});
}

// An image of values in [-1, 1], NCHW.
Tensor random_image(const Shape& shape, Rng& rng) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(2.0 * rng.uniform() - 1.0);
  return t;
}

TEST(FluxVae, EncodesAndDecodesWithTheLatentScaling) {
  FluxVaeParameters params(tiny_config());
  params.initialize_random(5);
  FluxVae vae(params);
  Rng rng(6);
  const Tensor image = random_image({2, 3, 8, 12}, rng);
  Tensor moments = Tensor::empty({2, 8, 4, 6}), mode = Tensor::empty({2, 4, 4, 6});
  Tensor sample = Tensor::empty({2, 4, 4, 6});
  vae.encode_moments(moments, image);
  vae.encode(mode, image);
  const Tensor zero_noise = Tensor::zeros({2, 4, 4, 6});
  vae.encode(sample, image, &zero_noise);
  EXPECT_EQ(testing::to_double(sample), testing::to_double(mode));
  std::vector<double> want;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 4 * 24; ++i)
      want.push_back((moments.data<float>()[b * 8 * 24 + i] - 0.1159) * 0.3611);
  EXPECT_LT(testing::relative_error(mode, want), 1e-6);
  Tensor decoded = Tensor::empty({2, 3, 8, 12});
  testing::fill_nan(decoded);
  vae.decode(decoded, mode);
  for (int64_t i = 0; i < decoded.numel(); ++i) ASSERT_TRUE(std::isfinite(decoded.data<float>()[i]));

  // A second pass of the same sizes reuses the activation buffers.
  const int64_t held = vae.activation_elements();
  vae.encode(mode, image);
  vae.decode(decoded, mode);
  EXPECT_EQ(vae.activation_elements(), held);
}

TEST(FluxVae, RefusesImagesAndLatentsOfTheWrongShape) {
  FluxVaeParameters params(tiny_config());
  FluxVae vae(params);
  expect_error([&] { vae.encode(Tensor::zeros({1, 4, 4, 5}), Tensor::zeros({1, 3, 8, 9})); },
               {"8x9", "multiples of 2"});
  expect_error([&] { vae.encode(Tensor::zeros({1, 4, 4, 4}), Tensor::zeros({1, 4, 8, 8})); }, {"[B, 3, H, W]"});
  expect_error([&] { vae.encode(Tensor::zeros({1, 4, 4, 5}), Tensor::zeros({1, 3, 8, 8})); }, {"latents"});
  expect_error([&] { vae.decode(Tensor::zeros({1, 3, 8, 8}), Tensor::zeros({1, 16, 4, 4})); }, {"latents"});
  expect_error([&] { vae.encode_moments(Tensor::zeros({1, 4, 4, 4}), Tensor::zeros({1, 3, 8, 8})); }, {"moments"});
}

}  // namespace
}  // namespace forge
