// precision.fp8 delayed's state between steps, as checkpoints keep it (NOTE [FP8 step end]
// in model/fp8_projections.h).
#pragma once

#include <cstdint>
#include <vector>

namespace forge {

// Whether the scales come from the histories yet, and per FP8 projection (parameter order,
// the head last) and role (x, W, dy) its amax history and its scale.
struct Fp8DelayedState {
  bool active = false;
  int64_t history_length = 0;
  std::vector<float> histories;  // [projections][3][history_length], newest last
  std::vector<float> scales;     // [projections][3]
};

}  // namespace forge
