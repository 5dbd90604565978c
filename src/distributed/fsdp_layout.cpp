#include "distributed/fsdp_layout.h"

#include <algorithm>

#include "core/error.h"

namespace forge {
namespace {

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

}  // namespace

FsdpLayout::FsdpLayout(const ModelConfig& config, int world_size, int rank, int expert_parallel,
                       TensorParallelShard tensor_parallel, const std::vector<PipelineStage>& pipeline_stages)
    : world_size_(world_size),
      rank_(rank),
      expert_parallel_(expert_parallel),
      specs_(parameter_specs(config, tensor_parallel)),
      pipeline_stages_(pipeline_stages) {
  FORGE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "FSDP layout for rank {} of {}", rank, world_size);
  const int p = expert_parallel;
  FORGE_CHECK(p >= 1 && world_size % p == 0 && (p == 1 || (config.moe() && config.num_experts % p == 0)),
              "FSDP layout: expert parallelism {} needs a world size ({}) and an expert count ({}) it divides", p,
              world_size, config.num_experts);
  // NOTE [FSDP layout]: a pipeline rank lays out its stages' parameters only, at their
  // places in the whole model's flat index space.
  const size_t num_units = static_cast<size_t>(config.num_layers) + 2;
  lay_out(pipeline_stage_specs(specs_, pipeline_stages), num_units, [&](size_t s) {
    const ParamSpec& spec = specs_[s];
    return spec.layer >= 0                  ? unit_of_layer(spec.layer)
           : spec.name == "embedding.weight" ? kEmbeddingUnit
                                             : static_cast<int>(num_units) - 1;
  });
}

FsdpLayout::FsdpLayout(std::vector<ParamSpec> specs, int num_units, int world_size, int rank)
    : world_size_(world_size), rank_(rank), expert_parallel_(1), specs_(std::move(specs)) {
  FORGE_CHECK(world_size >= 1 && rank >= 0 && rank < world_size, "FSDP layout for rank {} of {}", rank, world_size);
  FORGE_CHECK(num_units >= 2, "FSDP layout: a model of {} units (its two ends at least)", num_units);
  for (const ParamSpec& spec : specs_)
    FORGE_CHECK(spec.layer >= 0 && spec.layer < num_units, "FSDP layout: parameter '{}' names unit {} of {}",
                spec.name, spec.layer, num_units);
  lay_out(specs_, static_cast<size_t>(num_units), [&](size_t s) { return specs_[s].layer; });
}

void FsdpLayout::lay_out(const std::vector<ParamSpec>& held, size_t num_units,
                         const std::function<int(size_t)>& unit_of) {
  const int world_size = world_size_, rank = rank_, p = expert_parallel_;
  const int groups = world_size / p;  // the ranks holding the same experts
  units_.resize(num_units);
  std::vector<int64_t> expert_numel(units_.size(), 0);  // each unit's expert part so far
  size_t next_held = 0;  // held keeps specs_ order
  int64_t flat = 0;
  for (size_t s = 0; s < specs_.size(); ++s) {
    const ParamSpec& spec = specs_[s];
    if (next_held == held.size() || held[next_held].name != spec.name) {
      flat += shape_numel(spec.shape);
      continue;
    }
    ++next_held;
    const int u = unit_of(s);
    FsdpUnit& unit = units_[static_cast<size_t>(u)];
    const int64_t n = shape_numel(spec.shape);
    FsdpParam param{static_cast<int>(s), 0, n, flat, spec.shape, 0, false};
    if (p > 1 && spec.expert_stack) {  // this rank's experts' slice, in the expert part
      const int64_t local = n / p;
      param.numel = local;
      param.param_begin = (rank % p) * local;
      param.flat_offset = flat + param.param_begin;
      param.shape[0] /= p;
      param.expert = true;
      param.offset = round_up(expert_numel[static_cast<size_t>(u)], kFsdpAlign);  // within the part, for now
      expert_numel[static_cast<size_t>(u)] = param.offset + local;
    } else {
      param.offset = round_up(unit.numel, kFsdpAlign);
      unit.numel = param.offset + n;
    }
    unit.params.push_back(param);
    flat += n;
  }
  FORGE_CHECK(next_held == held.size(), "FSDP layout: {} of the stages' {} parameters are the model's", next_held,
              held.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    FsdpUnit& unit = units_[u];
    unit.shard_offset = shard_numel_;
    unit.full_offset = full_numel_;
    if (unit.params.empty()) continue;  // a unit of another pipeline rank's stages: empty
    const int64_t dense = round_up(std::max<int64_t>(unit.numel, 1), world_size * kFsdpAlign);
    unit.parts = {{0, dense, 0, dense / world_size, world_size, rank, false}};
    if (expert_numel[u] > 0) {
      const int64_t experts = round_up(expert_numel[u], groups * kFsdpAlign);
      unit.parts.push_back({dense, experts, dense / world_size, experts / groups, groups, rank / p, true});
      for (FsdpParam& param : unit.params)
        if (param.expert) param.offset += dense;
    }
    unit.numel = unit.shard_numel = 0;
    for (const FsdpPart& part : unit.parts) {
      unit.numel += part.numel;
      unit.shard_numel += part.shard_numel;
    }
    shard_numel_ += unit.shard_numel;
    full_numel_ += unit.numel;
  }
  for (size_t u = 0; u < units_.size(); ++u) {
    const FsdpUnit& unit = units_[u];
    for (const FsdpPart& part : unit.parts) {
      const int64_t begin = part.begin + part.index * part.shard_numel, end = begin + part.shard_numel;
      for (const FsdpParam& param : unit.params) {
        if (param.expert != part.expert) continue;
        const int64_t a = std::max(begin, param.offset), b = std::min(end, param.offset + param.numel);
        if (a >= b) continue;
        segments_.push_back({param.spec, static_cast<int>(u), param.param_begin + (a - param.offset), b - a,
                             unit.shard_offset + part.shard_begin + (a - begin), param.flat_offset + (a - param.offset),
                             specs_[static_cast<size_t>(param.spec)].weight_decay});
      }
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
  for (const FsdpUnit& unit : units_)
    for (const FsdpParam& p : unit.params) n += shape_numel(specs_[static_cast<size_t>(p.spec)].shape);
  return n;
}

int64_t FsdpLayout::flat_numel() const {
  int64_t n = 0;
  for (const ParamSpec& s : specs_) n += shape_numel(s.shape);
  return n;
}

}  // namespace forge
