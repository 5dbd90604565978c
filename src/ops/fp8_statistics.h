// The FP8 projections' statistics blocks at a step's end (NOTE [FP8 projection statistics]
// in kernels/cpu/fp8_scaling.h), on whichever device holds them: the CPU functions of
// kernels/cpu/fp8_scaling.h or their CUDA twins (kernels/cuda/fp8_delayed.h).
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "kernels/cpu/fp8_scaling.h"

namespace forge {

// stats: F32 [projections * kFp8ProjectionStats]; history: F32 [projections * kFp8Roles * length].
int64_t fp8_stats_projections(const Tensor& stats);
void fp8_stats_init(const Tensor& stats);
// projection * kFp8Roles + role of the first non-finite seen amax, or -1 (CUDA: waits for the stream).
int64_t fp8_stats_first_nonfinite(const Tensor& stats);
float fp8_stats_seen(const Tensor& stats, int64_t slot);  // the seen amax of that slot (host copy)
void fp8_stats_delayed_step(const Tensor& stats, const Tensor& history, const cpu::Fp8DelayedRecipe& recipe);
void fp8_stats_clear_seen(const Tensor& stats);

}  // namespace forge
