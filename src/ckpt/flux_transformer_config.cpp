// NOTE [FLUX transformer config.json] in flux_transformer_config.h.
#include "ckpt/flux_transformer_config.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "core/json_input.h"

namespace forge {
namespace fs = std::filesystem;

std::string flux_transformer_config_file(const std::string& path) {
  std::error_code error;
  if (fs::is_regular_file(path, error)) return fs::path(path).filename() == "config.json" ? path : "";
  for (const fs::path& candidate : {fs::path(path) / "config.json", fs::path(path) / "transformer" / "config.json"})
    if (fs::is_regular_file(candidate, error)) return candidate.string();
  return "";
}

FluxConfig read_flux_transformer_config(const std::string& path) {
  const std::string file = flux_transformer_config_file(path);
  if (file.empty()) FORGE_FAIL("{}: no config.json (a diffusers FluxTransformer2DModel folder has one)", path);
  const nlohmann::json j = read_json_file(file, "the FLUX transformer's config");
  if (!(j.is_object())) FORGE_FAIL("{}: expected a JSON object (FluxTransformer2DModel's config)", file);
  static const std::set<std::string> known = {
      "_class_name",         "_diffusers_version",  "_name_or_path",         "in_channels",
      "out_channels",        "num_layers",          "num_single_layers",     "attention_head_dim",
      "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds",
      "axes_dims_rope",      "patch_size"};
  for (const auto& [key, value] : j.items())
    if (!(known.contains(key)))
      FORGE_FAIL("{}: unknown key \"{}\" (forge reads FluxTransformer2DModel's: {})", file, key,
                 "in_channels, out_channels, num_layers, num_single_layers, attention_head_dim, num_attention_heads, "
                 "joint_attention_dim, pooled_projection_dim, guidance_embeds, axes_dims_rope, patch_size");
  if (j.contains("_class_name"))
    if (!(j["_class_name"] == "FluxTransformer2DModel"))
      FORGE_FAIL("{}: \"_class_name\" is {}; expected FluxTransformer2DModel", file, j["_class_name"].dump());
  auto integer = [&](const char* key, int64_t fallback) -> int64_t {
    if (!j.contains(key)) return fallback;
    if (!(j[key].is_number_integer() && j[key].get<int64_t>() >= 1))
      FORGE_FAIL("{}: \"{}\" must be a positive integer, got {}", file, key, j[key].dump());
    return j[key].get<int64_t>();
  };
  FluxConfig c = flux_preset("flux1-dev");
  c.in_channels = integer("in_channels", 64);
  c.out_channels = j.contains("out_channels") && j["out_channels"].is_null() ? 0 : integer("out_channels", 0);
  c.num_double_blocks = integer("num_layers", 19);
  c.num_single_blocks = integer("num_single_layers", 38);
  c.head_dim = integer("attention_head_dim", 128);
  c.num_heads = integer("num_attention_heads", 24);
  c.context_dim = integer("joint_attention_dim", 4096);
  c.pooled_dim = integer("pooled_projection_dim", 768);
  if (!(integer("patch_size", 1) == 1))
    FORGE_FAIL("{}: \"patch_size\" is {}; FLUX's transformer (and forge) uses 1", file, j["patch_size"].dump());
  c.guidance_embeds = false;
  if (j.contains("guidance_embeds")) {
    if (!(j["guidance_embeds"].is_boolean()))
      FORGE_FAIL("{}: \"guidance_embeds\" must be true or false, got {}", file, j["guidance_embeds"].dump());
    c.guidance_embeds = j["guidance_embeds"].get<bool>();
  }
  if (j.contains("axes_dims_rope")) {
    const nlohmann::json& a = j["axes_dims_rope"];
    bool ok = a.is_array() && !a.empty();
    if (ok)
      for (const nlohmann::json& v : a) ok = ok && v.is_number_integer() && v.get<int64_t>() >= 1;
    if (!(ok)) FORGE_FAIL("{}: \"axes_dims_rope\" must be a list of positive integers, got {}", file, a.dump());
    c.axes_dim = a.get<std::vector<int64_t>>();
  }
  c.name = "diffusers";
  for (const std::string& name : flux_preset_names()) {
    FluxConfig preset = flux_preset(name);
    preset.name = c.name;
    if (preset.in_channels == c.in_channels && preset.resolved_out_channels() == c.resolved_out_channels() &&
        preset.num_heads == c.num_heads && preset.head_dim == c.head_dim &&
        preset.num_double_blocks == c.num_double_blocks && preset.num_single_blocks == c.num_single_blocks &&
        preset.context_dim == c.context_dim && preset.pooled_dim == c.pooled_dim &&
        preset.guidance_embeds == c.guidance_embeds && preset.axes_dim == c.axes_dim)
      c.name = name;
  }
  c.validate(file);
  return c;
}

}  // namespace forge
