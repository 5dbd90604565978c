#include "distributed/fsdp_layout.h"

#include <algorithm>

#include "core/error.h"

namespace forge {
namespace {

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

FsdpLayout::FsdpLayout(const ModelConfig& config, int world_size, int rank)
    : world_size_(world_size), rank_(rank), specs_(parameter_specs(config)) {
  FORGE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "FSDP layout for rank {} of {}", rank, world_size);
  units_.resize(static_cast<size_t>(config.num_layers) + 2);
  int64_t flat = 0;
  for (size_t s = 0; s < specs_.size(); ++s) {
    const int u = specs_[s].layer >= 0           ? unit_of_layer(specs_[s].layer)
                  : specs_[s].name == "embedding.weight" ? kEmbeddingUnit
                                                         : head_unit();
    FsdpUnit& unit = units_[static_cast<size_t>(u)];
    const int64_t n = shape_numel(specs_[s].shape);
    unit.params.push_back({static_cast<int>(s), round_up(unit.numel, kFsdpAlign), n, flat});
    unit.numel = unit.params.back().offset + n;
    flat += n;
  }
  for (FsdpUnit& unit : units_) {
    unit.numel = round_up(std::max<int64_t>(unit.numel, 1), world_size * kFsdpAlign);
    unit.shard_numel = unit.numel / world_size;
    unit.shard_offset = shard_numel_;
    unit.full_offset = full_numel_;
    shard_numel_ += unit.shard_numel;
    full_numel_ += unit.numel;
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    const FsdpUnit& unit = units_[u];
    const int64_t begin = rank * unit.shard_numel, end = begin + unit.shard_numel;
    for (const FsdpParam& p : unit.params) {
      const int64_t a = std::max(begin, p.offset), b = std::min(end, p.offset + p.numel);
      if (a >= b) continue;
      const ParamSpec& spec = specs_[static_cast<size_t>(p.spec)];
      segments_.push_back({p.spec, static_cast<int>(u), a - p.offset, b - a, unit.shard_offset + (a - begin),
                           p.flat_offset + (a - p.offset), spec.weight_decay});
    }
  }
}

int64_t FsdpLayout::max_block_numel() const {
  int64_t m = 0;
  for (int u = 0; u < num_units(); ++u)
    if (is_block(u)) m = std::max(m, units_[static_cast<size_t>(u)].numel);
  return m;
}

int64_t FsdpLayout::max_unit_numel() const {
  int64_t m = 0;
  for (const FsdpUnit& unit : units_) m = std::max(m, unit.numel);
  return m;
}

int64_t FsdpLayout::max_shard_numel() const {
  int64_t m = 0;
  for (const FsdpUnit& unit : units_) m = std::max(m, unit.shard_numel);
  return m;
}

int64_t FsdpLayout::parameter_count() const {
  int64_t n = 0;
  for (const ParamSpec& s : specs_) n += shape_numel(s.shape);
  return n;
}

}  // namespace forge
