// precision.fp8 delayed's state between steps, as checkpoints keep it (NOTE [FP8 step end]
// in model/fp8_projections.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace forge {

// Whether the scales come from the histories yet, and per FP8 projection (parameter order,
// the head last) and role (x, W, dy) its amax history and its scale.
struct Fp8DelayedState {
  bool active = false;
  int64_t history_length = 0;
  // Whether the routed experts' blocks are among the projections (NOTE [FP8 routed experts
  // switch] in model/fp8_projections.h); true for checkpoints saved before the switch.
  bool routed_experts = true;
  // precision.fp8_filter_fqns of the run that saved it (NOTE [FP8 filter] in
  // model/fp8_projections.h): which block projections have no blocks; empty for checkpoints
  // saved before the filter.
  std::vector<std::string> filter_fqns;
  std::vector<float> histories;  // [projections][3][history_length], newest last
  std::vector<float> scales;     // [projections][3]
};

}  // namespace forge
