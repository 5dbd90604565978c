// FLUX's diffusers export, planned and staged; see flux_weights_export.h (NOTE [FLUX export
// in pieces]).
#include "ckpt/flux_weights_export.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "core/durable_directory.h"
#include "model/flux_parameters.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

// Exports are not flushed to disk: NOTE [Durable files] in core/durable_file.h says why.
constexpr DurableOptions kExportDurability{.sync = false};

nlohmann::json diffusers_config(const FluxConfig& c) {
  return {{"_class_name", "FluxTransformer2DModel"},
          {"_diffusers_version", "0.42.1"},
          {"attention_head_dim", c.head_dim},
          {"axes_dims_rope", c.axes_dim},
          {"guidance_embeds", c.guidance_embeds},
          {"in_channels", c.in_channels},
          {"joint_attention_dim", c.context_dim},
          {"num_attention_heads", c.num_heads},
          {"num_layers", c.num_double_blocks},
          {"num_single_layers", c.num_single_blocks},
          {"out_channels", c.out_channels > 0 ? nlohmann::json(c.out_channels) : nlohmann::json(nullptr)},
          {"patch_size", 1},
          {"pooled_projection_dim", c.pooled_dim}};
}

// The target as given, without a trailing separator; its parent created.
std::string prepare_target(const std::string& dir) {
  fs::path target = fs::path(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  if (target.empty()) FORGE_FAIL("FLUX diffusers export: no target directory given");
  if (fs::exists(target) && !fs::is_directory(target))
    FORGE_FAIL("cannot export the FLUX weights to '{}': it exists and is not a directory", target.string());
  std::error_code ec;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  if (ec) FORGE_FAIL("cannot create '{}': {}", target.parent_path().string(), ec.message());
  return target.string();
}

}  // namespace

HfExportPlan flux_weights_plan(const FluxConfig& config, SafetensorsDType stored, uint64_t max_shard_bytes) {
  return HfExportPlan(flux_parameter_specs(config), stored, max_shard_bytes, kFluxDiffusersStem);
}

FluxWeightsExport::FluxWeightsExport(const std::string& dir, const FluxConfig& config, SafetensorsDType stored,
                                     const std::string& temporary, uint64_t max_shard_bytes)
    : config_(config), plan_(flux_weights_plan(config, stored, max_shard_bytes)) {
  const std::string target = prepare_target(dir);
  staging_ = temporary.empty() ? std::make_unique<AtomicDirectory>(target, kExportDurability)
                               : std::make_unique<AtomicDirectory>(target, temporary, kExportDurability);
  plan_.create_files(staging_->temporary_path());
}

FluxWeightsExport::~FluxWeightsExport() = default;

const std::string& FluxWeightsExport::temporary_path() const { return staging_->temporary_path(); }

void FluxWeightsExport::commit() {
  const fs::path temp = staging_->temporary_path();
  if (plan_.files().size() > 1)
    write_file_atomic((temp / plan_.index_name()).string(), plan_.index_json(), kExportDurability);
  write_file_atomic((temp / "config.json").string(), diffusers_config(config_).dump(2) + "\n", kExportDurability);
  staging_->commit();  // exchanged with an existing target, which is then deleted
}

}  // namespace forge
