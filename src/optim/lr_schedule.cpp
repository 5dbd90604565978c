// lr_at: warm-up, then cosine, linear or constant decay (NOTE [LR schedule] in
// optim/optimizer.h). Each expression is written in the operation order of the PyTorch
// scheduler it mirrors, so the two agree to the last few bits.
#include <cmath>
#include <numbers>

#include "optim/optimizer.h"

namespace forge {

double lr_at(const OptimizerConfig& opt, const LRSchedulerConfig& sched, int64_t step, int64_t total_steps) {
  FORGE_CHECK(step >= 0, "lr_at: step is 0-based, got {}", step);
  const double peak = opt.lr;
  if (peak == 0) return 0;  // a dry run; min_lr <= lr makes every step's rate 0 (and linear divides by peak)
  const int64_t warmup = sched.warmup_steps;
  if (step < warmup) return peak * (static_cast<double>(step + 1) / static_cast<double>(warmup + 1));
  if (sched.decay_style == "constant") return peak;

  const int64_t decay_steps = sched.decay_steps > 0 ? sched.decay_steps : total_steps - warmup;
  const int64_t t = step - warmup;
  if (t >= decay_steps) return sched.min_lr;
  const double progress = static_cast<double>(t);
  const double length = static_cast<double>(decay_steps);
  if (sched.decay_style == "cosine")
    return sched.min_lr + (peak - sched.min_lr) * (1.0 + std::cos(std::numbers::pi * progress / length)) / 2.0;
  FORGE_CHECK(sched.decay_style == "linear", "lr_at: unknown decay_style '{}'", sched.decay_style);
  return peak * (1.0 + (sched.min_lr / peak - 1.0) * progress / length);
}

}  // namespace forge
