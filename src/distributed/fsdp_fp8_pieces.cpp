#include "distributed/fsdp_fp8_pieces.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "model/fp8_projections.h"

namespace forge {

bool fp8_gathered_param(const ParamSpec& spec, const Fp8Settings& settings) {
  return fp8_block_projection(spec, settings) || fp8_expert_stack(spec, settings);
}

std::vector<Fp8GatherPiece> fp8_param_pieces(const ModelConfig& config, const ParamSpec& spec, int param,
                                             int64_t offset, const Fp8Settings& settings) {
  std::vector<Fp8GatherPiece> pieces;
  if (!fp8_gathered_param(spec, settings)) return pieces;
  if (fp8_expert_stack(spec, settings)) {  // one piece per expert, with the expert's statistics block
    const int64_t matrix = spec.shape[1] * spec.shape[2];
    for (int64_t e = 0; e < spec.shape[0]; ++e)
      pieces.push_back({param, offset + e * matrix, matrix, fmt::format("{} (expert {})", spec.name, e)});
    return pieces;
  }
  const int64_t cols = spec.shape[1];
  if (config.mla() && spec.name.ends_with(".attention.kv_a.weight")) {  // its two row views
    const int64_t r = config.kv_lora_rank, rows = spec.shape[0];
    FORGE_CHECK(r > 0 && r < rows && rows == r + config.qk_rope_head_dim,
                "FSDP's FP8 all-gather: '{}' has {} rows, expected kv_lora_rank {} + qk_rope_head_dim {}", spec.name,
                rows, r, config.qk_rope_head_dim);
    pieces.push_back({param, offset, r * cols, spec.name});
    pieces.push_back({param, offset + r * cols, (rows - r) * cols, spec.name});
    return pieces;
  }
  pieces.push_back({param, offset, spec.shape[0] * cols, spec.name});
  return pieces;
}

std::vector<Fp8GatherPiece> fp8_unit_pieces(const ModelConfig& config, const std::vector<ParamSpec>& specs,
                                            const FsdpUnit& unit, const Fp8Settings& settings) {
  std::vector<Fp8GatherPiece> pieces;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const FsdpParam& p = unit.params[k];
    if (p.expert) continue;  // expert parallelism: the expert part travels in the compute dtype
    const ParamSpec& spec = specs.at(static_cast<size_t>(p.spec));
    // The dense part holds its parameters whole.
    FORGE_CHECK(!fp8_gathered_param(spec, settings) || p.numel == shape_numel(spec.shape),
                "FSDP's FP8 all-gather: '{}' is held in part ({} of {} elements) outside an expert part", spec.name,
                p.numel, shape_numel(spec.shape));
    for (Fp8GatherPiece& piece : fp8_param_pieces(config, spec, static_cast<int>(k), p.offset, settings))
      pieces.push_back(std::move(piece));
  }
  return pieces;
}

bool fp8_head_param(const ParamSpec& spec) { return spec.layer < 0 && spec.name == "output.weight"; }

std::vector<Fp8GatherPiece> fp8_head_pieces(const std::vector<ParamSpec>& specs, const FsdpUnit& unit) {
  std::vector<Fp8GatherPiece> pieces;
  for (size_t k = 0; k < unit.params.size(); ++k) {
    const FsdpParam& p = unit.params[k];
    const ParamSpec& spec = specs.at(static_cast<size_t>(p.spec));
    if (!fp8_head_param(spec)) continue;
    FORGE_CHECK(p.numel == shape_numel(spec.shape), "FSDP's FP8 all-gather: the head '{}' is held in part", spec.name);
    pieces.push_back({static_cast<int>(k), p.offset, p.numel, spec.name});
  }
  return pieces;
}

std::pair<int64_t, int64_t> fp8_piece_overlap(const Fp8GatherPiece& piece, int64_t begin, int64_t end) {
  const int64_t lo = std::min(std::max(begin, piece.offset), end);
  const int64_t hi = std::min(end, piece.offset + piece.numel);
  return {lo, std::max(lo, hi)};
}

}  // namespace forge
