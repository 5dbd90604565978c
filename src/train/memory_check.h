// The memory a run will need, from its config, and the check that refuses a run that
// cannot fit on its GPU before anything big is allocated (model/memory_estimate.h).
#pragma once

#include "model/memory_estimate.h"
#include "train/experiment.h"

namespace forge {

MemoryPlan memory_plan_of(const ExperimentConfig& config);

// precision.fp8's settings (NOTE [FP8 projections]; under LoRA, NOTE [FP8 frozen base]);
// unset with precision.fp8 none.
std::optional<Fp8Settings> fp8_settings_of(const ExperimentConfig& config);
// The recipe as forge info and the training log name it: "tensorwise", or "delayed (amax
// history 1024, max, margin 0)".
std::string fp8_recipe_description(const PrecisionConfig& precision);

// On CUDA: throws OutOfMemoryError naming the estimate, the GPU's free memory and the
// settings that would shrink the need, when the estimate plus kReserveBytes exceeds free
// memory. On the CPU the same against the host's available memory (NOTE [The memory
// check on the CPU] in memory_check.cpp).
void check_memory_fits(const ExperimentConfig& config);

}  // namespace forge
