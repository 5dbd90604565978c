#include "ckpt/hf_layout.h"

namespace forge {
namespace {

int64_t rows_of(const std::string& hf_name, const ParamSpec& spec, const ModelConfig& config) {
  if (spec.hf_names.size() == 1) return spec.shape.at(0);
  if (hf_name.ends_with(".q_proj.weight")) return config.q_size();
  if (hf_name.ends_with(".k_proj.weight") || hf_name.ends_with(".v_proj.weight")) return config.kv_size();
  if (hf_name.ends_with(".gate_proj.weight") || hf_name.ends_with(".up_proj.weight")) return config.ffn_hidden_size;
  FORGE_CHECK(false, "no row count for Hugging Face tensor '{}' of fused parameter '{}'", hf_name, spec.name);
}

}  // namespace

std::vector<HfPart> hf_parts(const ParamSpec& spec, const ModelConfig& config) {
  const int64_t row_elements = spec.shape.empty() ? 1 : shape_numel(spec.shape) / std::max<int64_t>(spec.shape[0], 1);
  std::vector<HfPart> parts;
  int64_t row = 0;
  for (const std::string& name : spec.hf_names) {
    Shape shape = spec.shape;
    shape[0] = rows_of(name, spec, config);
    parts.push_back({name, shape, row * row_elements});
    row += shape[0];
  }
  FORGE_CHECK(row == spec.shape.at(0), "Hugging Face parts of '{}' stack to {} rows, expected {}", spec.name, row,
              spec.shape.at(0));
  return parts;
}

}  // namespace forge
