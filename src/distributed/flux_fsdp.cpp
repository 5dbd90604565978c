// FLUX's FluxParamSource / FluxGradSink over FSDP; see flux_fsdp.h (NOTE [FLUX FSDP]).
#include "distributed/flux_fsdp.h"

#include "core/error.h"

namespace forge {

FsdpLayout flux_fsdp_layout(const FluxConfig& config, int world_size, int rank) {
  return FsdpLayout(flux_parameter_specs(config), flux_num_units(config), world_size, rank);
}

FluxFsdp::FluxFsdp(const FluxConfig& config, Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group,
                   const FsdpOptions& options)
    : fsdp_(std::make_unique<Fsdp>(flux_fsdp_layout(config, shard_group.world_size(), shard_group.rank()), device,
                                   shard_group, replicate_group, options)) {
  const FsdpLayout& layout = fsdp_->layout();
  unit_specs_.resize(static_cast<size_t>(layout.num_units()));
  for (int u = 0; u < layout.num_units(); ++u)
    for (const FsdpParam& p : layout.units()[static_cast<size_t>(u)].params)
      unit_specs_[static_cast<size_t>(u)].push_back(&layout.specs()[static_cast<size_t>(p.spec)]);
  weights_.resize(unit_specs_.size());
  grads_.resize(unit_specs_.size());
}

FluxUnitWeights FluxFsdp::views(const BlockWeights& w, int index) const {
  std::vector<Tensor> tensors;
  tensors.reserve(w.params.size());
  for (const LinearWeight& p : w.params) tensors.push_back(p.weight);
  return flux_unit_weights(unit_specs_.at(static_cast<size_t>(index)), tensors);
}

const FluxUnitWeights& FluxFsdp::unit(int index) {
  FluxUnitWeights& w = weights_.at(static_cast<size_t>(index));
  w = views(fsdp_->unit_weights(index), index);
  return w;
}

const FluxUnitWeights& FluxFsdp::unit_grads(int index) {
  FluxUnitWeights& g = grads_.at(static_cast<size_t>(index));
  g = views(fsdp_->unit_gradients(index), index);
  return g;
}

void FluxFsdp::unit_done(int index) { fsdp_->unit_gradients_done(index); }

}  // namespace forge
