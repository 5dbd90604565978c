// FluxFsdp: FLUX's weights and gradients sharded over the data-parallel ranks by the
// decoder's FSDP (distributed/fsdp.h), laid out from FLUX's units (NOTE [FSDP of a model
// of units]), and handed to the FLUX transformer as its FluxParamSource / FluxGradSink.
//
// NOTE [FLUX FSDP]
// FLUX's units (NOTE [FLUX units] in model/flux_parameters.h: the embedders, each double
// and each single block, the head) are FSDP's units: every rank owns one chunk of each,
// holding its fp32 master weights, its fp32 gradient and the AdamW moments of that chunk;
// the embedders and the head are held in full in the compute dtype (the two ends of every
// micro-batch, as the decoder's embedding and head), and the blocks as the ZeRO stage says
// (ZeRO-1/2 in full; ZeRO-3 gathered around their use, one block ahead in the forward and
// one behind in the backward). The backward's units finish in the order FSDP reduces
// them: the head, the single blocks from the last, the double blocks from the last, the
// embedders. This class only views FSDP's buffers as FluxUnitWeights; everything else is
// Fsdp's. A micro-batch's gradient buffers are fresh under ZeRO-2/3 (a rotating buffer per
// unit), so the model writes them over (backward's `overwrite`) on every micro-batch; under
// ZeRO-1 the full gradients are written over by the step's first micro-batch and added to
// by the others, as on one device. The flat index space of Fsdp's segments is
// flux_parameter_specs end to end, which is a FLUX checkpoint's (NOTE [FLUX checkpoints]),
// so each rank saves and loads its own segments.
#pragma once

#include <memory>
#include <vector>

#include "distributed/fsdp.h"
#include "model/flux_config.h"
#include "model/flux_parameters.h"

namespace forge {

// The FsdpLayout of `config`'s parameters for rank `rank` of `world_size` shard ranks.
FsdpLayout flux_fsdp_layout(const FluxConfig& config, int world_size, int rank);

class FluxFsdp final : public FluxParamSource, public FluxGradSink {
 public:
  // options: zero_stage and reduce_dtype (NOTE [FSDP of a model of units]).
  FluxFsdp(const FluxConfig& config, Device device, ProcessGroup& shard_group, ProcessGroup* replicate_group,
           const FsdpOptions& options);

  Fsdp& fsdp() { return *fsdp_; }
  const Fsdp& fsdp() const { return *fsdp_; }
  // Whether the backward writes over the gradient buffers on micro-batch `micro` of a step.
  bool overwrite_gradients(int64_t micro) const { return micro == 0 || fsdp_->options().zero_stage >= 2; }

  const FluxUnitWeights& unit(int index) override;
  const FluxUnitWeights& unit_grads(int index) override;
  void unit_done(int index) override;

 private:
  FluxUnitWeights views(const BlockWeights& w, int index) const;

  std::unique_ptr<Fsdp> fsdp_;
  std::vector<std::vector<const ParamSpec*>> unit_specs_;  // into fsdp_->layout().specs()
  std::vector<FluxUnitWeights> weights_, grads_;  // the last views handed out, per unit
};

}  // namespace forge
