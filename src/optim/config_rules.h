// The rules of the optimizer and lr_scheduler sections, each written once: validate()
// checks them, and the cli's schema reads the bounds and choices below to reject a bad
// value where it is set and to say in --help what a key accepts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/config_check.h"
#include "optim/optimizer.h"

namespace forge {
namespace optim_bounds {

inline const std::vector<std::string> optimizer_names = {"adamw"};
// 0 is a dry run: the whole pipeline runs and the weights stay as they were.
inline constexpr ValueRange lr = at_least(0);
// [0, 1): a beta of 1 would divide by zero in Adam's bias correction.
inline constexpr ValueRange beta = {0.0, 1.0, false, true};
inline constexpr ValueRange eps = above(0);
inline constexpr ValueRange weight_decay = at_least(0);
inline const std::vector<std::string> state_dtypes = {"fp32", "bf16"};
inline const std::vector<std::string> master_dtypes = {"fp32", "bf16"};

inline constexpr ValueRange warmup_steps = at_least(0);
inline const std::vector<std::string> decay_styles = {"cosine", "linear", "constant"};
inline constexpr ValueRange decay_steps = at_least(0);  // 0: until training ends
inline constexpr ValueRange min_lr = at_least(0);

// training.steps: the schedule's length, so its bound is the optimizer's.
inline constexpr ValueRange total_steps = at_least(1);

}  // namespace optim_bounds

// Checks both sections and the run length before a run starts. Messages name each key as
// the user writes it ("optimizer.lr must be > 0, got -1"); `keys` adds where each value
// came from (the cli's; NOTE [Config rules name their keys through the caller]).
// total_steps is training.steps.
void validate(const OptimizerConfig& opt, const LRSchedulerConfig& sched, int64_t total_steps,
              const KeyDescriber& keys = {});

}  // namespace forge
