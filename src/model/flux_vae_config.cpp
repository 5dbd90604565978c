// FluxVaeConfig's presets, validation, parameter count and diffusers config.json; see
// flux_vae_config.h.
#include "model/flux_vae_config.h"

#include <cmath>
#include <filesystem>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/checked_math.h"
#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace {

using Count = std::optional<int64_t>;

Count conv_params(int64_t in, int64_t out, int64_t kernel) {
  return checked_add(checked_product({out, in, kernel, kernel}), Count(out));
}
Count norm_params(int64_t channels) { return checked_mul(int64_t{2}, channels); }
Count resnet_params(int64_t in, int64_t out) {
  Count n = checked_add(checked_add(norm_params(in), conv_params(in, out, 3)),
                        checked_add(norm_params(out), conv_params(out, out, 3)));
  return in == out ? n : checked_add(n, conv_params(in, out, 1));
}
Count mid_block_params(const FluxVaeConfig& c) {
  const int64_t ch = c.block_out_channels.back();
  Count n = checked_mul(Count(2), resnet_params(ch, ch));
  if (!c.mid_block_add_attention) return n;
  // group_norm, then to_q, to_k, to_v and to_out.0, each a [C, C] weight and a [C] bias.
  const Count projection = checked_add(checked_mul(ch, ch), Count(ch));
  return checked_add(n, checked_add(norm_params(ch), checked_mul(Count(4), projection)));
}

}  // namespace

void FluxVaeConfig::validate(std::string_view source) const {
  auto positive = [&](const char* key, int64_t v) {
    FORGE_CHECK(v > 0, "{}: \"{}\" must be positive, got {}", source, key, v);
  };
  positive("in_channels", in_channels);
  positive("out_channels", out_channels);
  positive("latent_channels", latent_channels);
  positive("layers_per_block", layers_per_block);
  positive("norm_num_groups", norm_num_groups);
  FORGE_CHECK(!block_out_channels.empty() && block_out_channels.size() <= 16,
              "{}: \"block_out_channels\" must list 1 to 16 levels, got {}", source, block_out_channels.size());
  for (int64_t c : block_out_channels)
    FORGE_CHECK(c > 0 && c % norm_num_groups == 0,
                "{}: \"block_out_channels\" [{}] must be positive multiples of \"norm_num_groups\" {} (GroupNorm "
                "splits every level's channels into that many groups)",
                source, fmt::join(block_out_channels, ", "), norm_num_groups);
  FORGE_CHECK(std::isfinite(scaling_factor) && scaling_factor > 0.0f,
              "{}: \"scaling_factor\" must be a positive number, got {}", source, scaling_factor);
  FORGE_CHECK(std::isfinite(shift_factor), "{}: \"shift_factor\" must be a finite number, got {}", source,
              shift_factor);
  FORGE_CHECK(norm_eps > 0.0f, "{}: the GroupNorm eps must be positive, got {}", source, norm_eps);
  FORGE_CHECK(checked_total_params().has_value(), "{}: the parameter count overflows", source);
}

std::optional<int64_t> FluxVaeConfig::checked_total_params() const {
  if (block_out_channels.empty()) return 0;
  const std::vector<int64_t>& ch = block_out_channels;
  const int64_t last = ch.back(), latent = latent_channels;
  Count n = conv_params(in_channels, ch[0], 3);  // encoder
  for (size_t i = 0; i < ch.size(); ++i) {
    n = checked_add(n, resnet_params(i == 0 ? ch[0] : ch[i - 1], ch[i]));
    n = checked_add(n, checked_mul(Count(layers_per_block - 1), resnet_params(ch[i], ch[i])));
    if (i + 1 < ch.size()) n = checked_add(n, conv_params(ch[i], ch[i], 3));
  }
  n = checked_add(n, checked_add(mid_block_params(*this), norm_params(last)));
  const Count moments = checked_mul(int64_t{2}, latent);  // the mean and the log-variance
  if (!moments) return std::nullopt;
  n = checked_add(n, conv_params(last, *moments, 3));
  if (use_quant_conv) n = checked_add(n, conv_params(*moments, *moments, 1));
  if (use_post_quant_conv) n = checked_add(n, conv_params(latent, latent, 1));
  n = checked_add(n, checked_add(conv_params(latent, last, 3), mid_block_params(*this)));  // decoder
  int64_t previous = last;
  for (size_t i = 0; i < ch.size(); ++i) {
    const int64_t c = ch[ch.size() - 1 - i];
    n = checked_add(n, resnet_params(previous, c));
    n = checked_add(n, checked_mul(Count(layers_per_block), resnet_params(c, c)));
    if (i + 1 < ch.size()) n = checked_add(n, conv_params(c, c, 3));
    previous = c;
  }
  return checked_add(n, checked_add(norm_params(ch[0]), conv_params(ch[0], out_channels, 3)));
}

bool FluxVaeConfig::same_model(const FluxVaeConfig& o) const {
  return in_channels == o.in_channels && out_channels == o.out_channels && latent_channels == o.latent_channels &&
         block_out_channels == o.block_out_channels && layers_per_block == o.layers_per_block &&
         norm_num_groups == o.norm_num_groups && mid_block_add_attention == o.mid_block_add_attention &&
         use_quant_conv == o.use_quant_conv && use_post_quant_conv == o.use_post_quant_conv &&
         scaling_factor == o.scaling_factor && shift_factor == o.shift_factor && norm_eps == o.norm_eps;
}

std::vector<std::string> flux_vae_preset_names() { return {"flux1-vae", "flux-vae-debug"}; }

FluxVaeConfig flux_vae_preset(std::string_view name) {
  FluxVaeConfig c;
  c.name = std::string(name);
  if (name == "flux1-vae") return c;  // the defaults: FLUX.1-dev's vae/config.json
  if (name == "flux-vae-debug") {
    c.block_out_channels = {16, 32};
    c.layers_per_block = 1;
    c.norm_num_groups = 8;
    return c;
  }
  FORGE_FAIL("unknown FLUX VAE '{}': expected one of {}", name, fmt::join(flux_vae_preset_names(), ", "));
}

FluxVaeConfig flux_vae_config_from_diffusers(const nlohmann::json& j, const std::string& path) {
  FORGE_CHECK(j.is_object(), "{}: expected a JSON object (a diffusers AutoencoderKL config), got {}", path,
              describe_json(j));
  // AutoencoderKL.__init__'s defaults (diffusers 0.42), which a config that leaves a key out gets.
  FluxVaeConfig c;
  const std::string folder = std::filesystem::path(path).parent_path().string();
  c.name = folder.empty() ? path : folder;
  c.in_channels = 3;
  c.out_channels = 3;
  c.latent_channels = 4;
  c.block_out_channels = {64};
  c.layers_per_block = 1;
  c.norm_num_groups = 32;
  c.mid_block_add_attention = true;
  c.use_quant_conv = true;
  c.use_post_quant_conv = true;
  c.scaling_factor = 0.18215f;
  c.shift_factor = 0.0f;
  std::vector<std::string> down_types = {"DownEncoderBlock2D"}, up_types = {"UpDecoderBlock2D"};
  auto fail = [&](const std::string& key, const nlohmann::json& value, const std::string& expected) {
    FORGE_FAIL("{}: \"{}\" is {}, expected {}", path, key, describe_json(value), expected);
  };
  auto integer = [&](const std::string& key, const nlohmann::json& v) -> int64_t {
    if (!v.is_number_integer() || v.get<int64_t>() <= 0) fail(key, v, "a positive integer");
    return v.get<int64_t>();
  };
  auto boolean = [&](const std::string& key, const nlohmann::json& v) -> bool {
    if (!v.is_boolean()) fail(key, v, "true or false");
    return v.get<bool>();
  };
  auto number = [&](const std::string& key, const nlohmann::json& v) -> float {
    if (!v.is_number() || !std::isfinite(v.get<double>())) fail(key, v, "a number");
    return static_cast<float>(v.get<double>());
  };
  auto names = [&](const std::string& key, const nlohmann::json& v) -> std::vector<std::string> {
    if (!v.is_array() || v.empty()) fail(key, v, "a list of block type names");
    std::vector<std::string> out;
    for (const auto& e : v) {
      if (!e.is_string()) fail(key, v, "a list of block type names");
      out.push_back(e.get<std::string>());
    }
    return out;
  };
  for (const auto& [key, v] : j.items()) {
    if (key == "_class_name") {
      if (v != "AutoencoderKL") fail(key, v, "\"AutoencoderKL\" (forge reads diffusers' AutoencoderKL only)");
    } else if (key.starts_with("_")) {  // _diffusers_version, _name_or_path: provenance only
    } else if (key == "in_channels") {
      c.in_channels = integer(key, v);
    } else if (key == "out_channels") {
      c.out_channels = integer(key, v);
    } else if (key == "latent_channels") {
      c.latent_channels = integer(key, v);
    } else if (key == "layers_per_block") {
      c.layers_per_block = integer(key, v);
    } else if (key == "norm_num_groups") {
      c.norm_num_groups = integer(key, v);
    } else if (key == "block_out_channels") {
      if (!v.is_array() || v.empty()) fail(key, v, "a list of positive integers");
      c.block_out_channels.clear();
      for (const auto& e : v) c.block_out_channels.push_back(integer(key, e));
    } else if (key == "down_block_types") {
      down_types = names(key, v);
    } else if (key == "up_block_types") {
      up_types = names(key, v);
    } else if (key == "act_fn") {
      if (v != "silu" && v != "swish") fail(key, v, "\"silu\" (forge's VAE blocks use SiLU)");
    } else if (key == "mid_block_add_attention") {
      c.mid_block_add_attention = boolean(key, v);
    } else if (key == "use_quant_conv") {
      c.use_quant_conv = boolean(key, v);
    } else if (key == "use_post_quant_conv") {
      c.use_post_quant_conv = boolean(key, v);
    } else if (key == "scaling_factor") {
      c.scaling_factor = number(key, v);
    } else if (key == "shift_factor") {
      c.shift_factor = v.is_null() ? 0.0f : number(key, v);
    } else if (key == "latents_mean" || key == "latents_std") {
      if (!v.is_null())
        fail(key, v, "null (per-channel latent statistics are another model's latent scaling, not FLUX's)");
    } else if (key == "force_upcast") {  // a pipeline's dtype choice: forge picks the dtype by device
      boolean(key, v);
    } else if (key == "sample_size") {  // the tile size of diffusers' tiled decoding, which forge does not do
      if (!(v.is_number_integer() || v.is_array())) fail(key, v, "an integer or a list of integers");
    } else {
      FORGE_FAIL("{}: unknown key \"{}\" for a diffusers AutoencoderKL (forge knows in_channels, out_channels, "
                 "latent_channels, block_out_channels, down_block_types, up_block_types, layers_per_block, "
                 "norm_num_groups, act_fn, mid_block_add_attention, use_quant_conv, use_post_quant_conv, "
                 "scaling_factor, shift_factor, latents_mean, latents_std, force_upcast, sample_size)",
                 path, key);
    }
  }
  const size_t levels = c.block_out_channels.size();
  for (const auto& [key, types, want] : {std::tuple{"down_block_types", down_types, "DownEncoderBlock2D"},
                                         std::tuple{"up_block_types", up_types, "UpDecoderBlock2D"}}) {
    if (types.size() != levels)
      FORGE_FAIL("{}: \"{}\" lists {} blocks, \"block_out_channels\" {} levels", path, key, types.size(), levels);
    for (const std::string& t : types)
      if (t != want) FORGE_FAIL("{}: \"{}\" holds \"{}\": forge's VAE has {} blocks only", path, key, t, want);
  }
  c.validate(path);
  return c;
}

FluxVaeConfig read_flux_vae_config(const std::string& path) {
  return flux_vae_config_from_diffusers(read_json_file(path, "the VAE's config.json"), path);
}

}  // namespace forge
