// FLUX VAE parameter names, shapes and the buffer holding them; see flux_vae_parameters.h.
#include "model/flux_vae_parameters.h"

#include <cmath>

#include "core/rng.h"
#include "ops/elementwise.h"

namespace forge {
namespace {

constexpr int64_t kAlignment = 64;  // values

// Appends specs in diffusers' module order.
struct SpecList {
  std::vector<FluxVaeParamSpec> specs;

  void vector(const std::string& name, int64_t n) { specs.push_back({name, {n}, {{name, n}}, false}); }
  void norm(const std::string& prefix, int64_t channels) {
    vector(prefix + ".weight", channels);
    vector(prefix + ".bias", channels);
  }
  void conv(const std::string& prefix, int64_t in, int64_t out, int64_t kernel) {
    specs.push_back({prefix + ".weight", {out, kernel, kernel, in}, {{prefix + ".weight", out}}, true});
    vector(prefix + ".bias", out);
  }
  void resnet(const std::string& prefix, int64_t in, int64_t out) {
    norm(prefix + ".norm1", in);
    conv(prefix + ".conv1", in, out, 3);
    norm(prefix + ".norm2", out);
    conv(prefix + ".conv2", out, out, 3);
    if (in != out) conv(prefix + ".conv_shortcut", in, out, 1);
  }
  void attention(const std::string& prefix, int64_t c) {
    norm(prefix + ".group_norm", c);
    for (const char* part : {".weight", ".bias"}) {
      Shape shape = std::string(part) == ".weight" ? Shape{3 * c, c} : Shape{3 * c};
      specs.push_back({prefix + ".to_qkv" + part,
                       shape,
                       {{prefix + ".to_q" + part, c}, {prefix + ".to_k" + part, c}, {prefix + ".to_v" + part, c}},
                       false});
    }
    specs.push_back({prefix + ".to_out.0.weight", {c, c}, {{prefix + ".to_out.0.weight", c}}, false});
    vector(prefix + ".to_out.0.bias", c);
  }
  void mid_block(const std::string& prefix, const FluxVaeConfig& config) {
    const int64_t c = config.block_out_channels.back();
    if (config.mid_block_add_attention) attention(prefix + ".attentions.0", c);
    resnet(prefix + ".resnets.0", c, c);
    resnet(prefix + ".resnets.1", c, c);
  }
};

}  // namespace

Shape FluxVaeParamSpec::file_shape(int64_t rows) const {
  if (conv) return {rows, shape[3], shape[1], shape[2]};
  Shape s = shape;
  s[0] = rows;
  return s;
}

std::vector<FluxVaeParamSpec> flux_vae_parameter_specs(const FluxVaeConfig& c) {
  c.validate(c.name);
  const std::vector<int64_t>& ch = c.block_out_channels;
  const size_t levels = ch.size();
  SpecList list;
  list.conv("encoder.conv_in", c.in_channels, ch[0], 3);
  for (size_t i = 0; i < levels; ++i) {
    const std::string block = "encoder.down_blocks." + std::to_string(i);
    for (int64_t j = 0; j < c.layers_per_block; ++j)
      list.resnet(block + ".resnets." + std::to_string(j), j == 0 && i > 0 ? ch[i - 1] : ch[i], ch[i]);
    if (i + 1 < levels) list.conv(block + ".downsamplers.0.conv", ch[i], ch[i], 3);
  }
  list.mid_block("encoder.mid_block", c);
  list.norm("encoder.conv_norm_out", ch.back());
  list.conv("encoder.conv_out", ch.back(), 2 * c.latent_channels, 3);
  if (c.use_quant_conv) list.conv("quant_conv", 2 * c.latent_channels, 2 * c.latent_channels, 1);
  if (c.use_post_quant_conv) list.conv("post_quant_conv", c.latent_channels, c.latent_channels, 1);
  list.conv("decoder.conv_in", c.latent_channels, ch.back(), 3);
  list.mid_block("decoder.mid_block", c);
  int64_t previous = ch.back();
  for (size_t i = 0; i < levels; ++i) {
    const int64_t out = ch[levels - 1 - i];
    const std::string block = "decoder.up_blocks." + std::to_string(i);
    for (int64_t j = 0; j <= c.layers_per_block; ++j)
      list.resnet(block + ".resnets." + std::to_string(j), j == 0 ? previous : out, out);
    if (i + 1 < levels) list.conv(block + ".upsamplers.0.conv", out, out, 3);
    previous = out;
  }
  list.norm("decoder.conv_norm_out", ch[0]);
  list.conv("decoder.conv_out", ch[0], c.out_channels, 3);
  return list.specs;
}

FluxVaeParameters::FluxVaeParameters(const FluxVaeConfig& config, Device device, DType dtype)
    : config_(config), specs_(flux_vae_parameter_specs(config)) {
  FORGE_CHECK(dtype == DType::F32 || (device == Device::CUDA && dtype == DType::BF16),
              "FLUX VAE parameters are fp32 on the CPU and bf16 or fp32 on CUDA, not {} on {}", dtype_name(dtype),
              device_name(device));
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const FluxVaeParamSpec& s : specs_) {
    offsets.push_back(total);
    total += (shape_numel(s.shape) + kAlignment - 1) / kAlignment * kAlignment;
  }
  flat_ = Tensor::zeros({total}, dtype, device);
  for (size_t i = 0; i < specs_.size(); ++i) {
    tensors_.push_back(flat_.narrow(offsets[i], offsets[i] + shape_numel(specs_[i].shape)).view(specs_[i].shape));
    index_.emplace(specs_[i].name, i);
  }
}

const Tensor& FluxVaeParameters::get(const std::string& name) const {
  auto it = index_.find(name);
  FORGE_CHECK(it != index_.end(), "the FLUX VAE {} has no parameter '{}'", config_.name, name);
  return tensors_[it->second];
}

void FluxVaeParameters::assign_from(const FluxVaeParameters& other) {
  FORGE_CHECK(other.config_.same_model(config_) && other.flat_.numel() == flat_.numel(),
              "FluxVaeParameters::assign_from: the weights of {} into the VAE {}", other.config_.name, config_.name);
  if (other.flat_.device() == flat_.device())
    cast(flat_, other.flat_);
  else
    cast(flat_, other.flat_.to(flat_.device()));
}

void FluxVaeParameters::initialize_random(uint64_t seed) {
  if (device() != Device::CPU || dtype() != DType::F32) {
    FluxVaeParameters host(config_);
    host.initialize_random(seed);
    assign_from(host);
    return;
  }
  for (size_t i = 0; i < specs_.size(); ++i) {
    const FluxVaeParamSpec& s = specs_[i];
    uint64_t name_hash = 1469598103934665603ull;
    for (char ch : s.name) name_hash = (name_hash ^ static_cast<uint8_t>(ch)) * 1099511628211ull;
    Rng rng(derive_seed(seed, name_hash));
    float* p = tensors_[i].data<float>();
    const int64_t n = tensors_[i].numel();
    const bool matrix = s.shape.size() > 1, norm_weight = !matrix && s.name.ends_with(".weight");
    const double std = matrix ? 1.0 / std::sqrt(static_cast<double>(n / s.shape[0])) : 0.2;
    for (int64_t j = 0; j < n; ++j) p[j] = static_cast<float>((norm_weight ? 1.0 : 0.0) + std * rng.normal());
  }
}

}  // namespace forge
