// The end of an optimizer step for the FP8 projections' statistics on the device: the
// CUDA twins of fp8_first_nonfinite_seen, fp8_delayed_step and fp8_clear_seen (NOTE [FP8
// projection statistics] in kernels/cpu/fp8_scaling.h), bit for bit.
#pragma once

#include <cstdint>

#include "kernels/cpu/fp8_scaling.h"

namespace forge::cuda {

// Fresh blocks (seen 0, scales 1) for `projections` blocks at stats (device).
void fp8_init_stats(float* stats, int64_t projections);
// projection * kFp8Roles + role of the first non-finite seen amax, or -1. Waits for the
// stream (one 4-byte copy to the host): once per optimizer step, where the trainer has
// synchronized for the loss already.
int64_t fp8_first_nonfinite_seen(const float* stats, int64_t projections);
// TE's delayed update of every projection and role, then seen zeroed; enqueued only.
void fp8_delayed_step(float* stats, float* history, int64_t projections, const cpu::Fp8DelayedRecipe& recipe);
void fp8_clear_seen(float* stats, int64_t projections);

}  // namespace forge::cuda
