// FluxVaeConfig: the architecture of FLUX.1's autoencoder, diffusers' AutoencoderKL with
// DownEncoderBlock2D / UpDecoderBlock2D blocks, as black-forest-labs/FLUX.1-dev's
// vae/config.json describes it (FLUX.1-schnell ships the same VAE).
//
// NOTE [FLUX VAE architecture]
// Encoder: conv_in (3x3, in_channels -> block_out_channels[0]); per level i a down block of
// layers_per_block ResNet blocks to block_out_channels[i] and, except at the last level, a
// 3x3 stride-2 convolution (NOTE [VAE downsample padding] in ops/conv2d.cpp); a mid block
// (ResNet, single-head self-attention over the pixels with the channels as the head dim,
// ResNet); GroupNorm + SiLU; conv_out (3x3) to 2 x latent_channels: the mean and the
// log-variance of the latent distribution (quant_conv, a 1x1 convolution, after it when
// use_quant_conv). Decoder: (post_quant_conv, 1x1, when use_post_quant_conv) conv_in (3x3,
// latent_channels -> block_out_channels[-1]); the mid block; up blocks over the channels
// reversed, each layers_per_block + 1 ResNet blocks and, except the last, nearest 2x
// upsampling then a 3x3 convolution; GroupNorm + SiLU; conv_out (3x3) to out_channels. A
// ResNet block is x + conv2(SiLU(GN(conv1(SiLU(GN(x)))))), x through a 1x1 conv_shortcut
// when its channel count changes. Every GroupNorm has norm_num_groups groups and eps 1e-6
// (diffusers' Encoder and Decoder fix it). Images shrink by 2^(levels - 1) each side: 8 for
// FLUX's four levels, whose 512-channel mid blocks attend over (H/8)(W/8) pixels.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace forge {

struct FluxVaeConfig {
  std::string name;
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  int64_t latent_channels = 16;
  std::vector<int64_t> block_out_channels = {128, 256, 512, 512};
  int64_t layers_per_block = 2;
  int64_t norm_num_groups = 32;
  bool mid_block_add_attention = true;
  bool use_quant_conv = false;
  bool use_post_quant_conv = false;
  // NOTE [FLUX VAE latents] in model/flux_vae.h: latents = (z - shift_factor) * scaling_factor.
  float scaling_factor = 0.3611f;
  float shift_factor = 0.1159f;
  float norm_eps = 1e-6f;

  int64_t levels() const { return static_cast<int64_t>(block_out_channels.size()); }
  // Pixels per latent pixel along each side: 2^(levels - 1).
  int64_t downsample_factor() const { return int64_t{1} << (levels() - 1); }

  // Throws naming the bad knob and `source` (the file or preset it came from).
  void validate(std::string_view source = "flux vae config") const;
  // Every parameter (as diffusers counts them; nothing when the count overflows int64).
  std::optional<int64_t> checked_total_params() const;
  // The same architecture and latent scaling (the name aside).
  bool same_model(const FluxVaeConfig& other) const;
};

// "flux1-vae" (FLUX.1-dev's and FLUX.1-schnell's VAE: 83,819,683 parameters) and
// "flux-vae-debug" (two levels of 16 and 32 channels, 16 latent channels: the latent width
// the flux-debug transformer reads, in milliseconds on a CPU). Throws listing the names for
// any other.
FluxVaeConfig flux_vae_preset(std::string_view name);
std::vector<std::string> flux_vae_preset_names();

// A diffusers AutoencoderKL config.json (parsed), read as diffusers reads it: a key left out
// takes AutoencoderKL's default. Every key is checked: one forge does not know, or a value
// it would compute differently (another block type or activation, latents_mean / _std, a
// group count that does not divide the channels), fails naming `path` and the key.
FluxVaeConfig flux_vae_config_from_diffusers(const nlohmann::json& config, const std::string& path);
// Reads and maps the config.json file at `path`; the model is named after its folder.
FluxVaeConfig read_flux_vae_config(const std::string& path);

}  // namespace forge
