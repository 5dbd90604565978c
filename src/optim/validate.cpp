// Validation of the optimizer and lr_scheduler config sections. Every message names the
// key as it is written in YAML or on the command line, and says what is expected.
// Comparisons are written so that NaN fails them.
#include "optim/optimizer.h"

namespace forge {
namespace {

void check_beta(const char* key, double beta) {
  if (!(beta >= 0.0 && beta < 1.0)) FORGE_FAIL("optimizer.{} must be in [0, 1), got {}", key, beta);
}

}  // namespace

void validate(const OptimizerConfig& opt, const LRSchedulerConfig& sched, int64_t total_steps) {
  if (opt.name != "adamw") FORGE_FAIL("optimizer.name must be adamw, got '{}'", opt.name);
  if (!(opt.lr > 0.0)) FORGE_FAIL("optimizer.lr must be > 0, got {}", opt.lr);
  check_beta("beta1", opt.beta1);
  check_beta("beta2", opt.beta2);
  if (!(opt.eps > 0.0)) FORGE_FAIL("optimizer.eps must be > 0, got {}", opt.eps);
  if (!(opt.weight_decay >= 0.0)) FORGE_FAIL("optimizer.weight_decay must be >= 0, got {}", opt.weight_decay);

  if (sched.warmup_steps < 0) FORGE_FAIL("lr_scheduler.warmup_steps must be >= 0, got {}", sched.warmup_steps);
  if (sched.decay_style != "cosine" && sched.decay_style != "linear" && sched.decay_style != "constant")
    FORGE_FAIL("lr_scheduler.decay_style must be one of cosine, linear, constant, got '{}'", sched.decay_style);
  if (sched.decay_steps < 0) FORGE_FAIL("lr_scheduler.decay_steps must be >= 0, got {}", sched.decay_steps);
  if (!(sched.min_lr >= 0.0)) FORGE_FAIL("lr_scheduler.min_lr must be >= 0, got {}", sched.min_lr);
  if (sched.min_lr > opt.lr)
    FORGE_FAIL("lr_scheduler.min_lr ({}) must be <= optimizer.lr ({})", sched.min_lr, opt.lr);

  if (total_steps <= 0) FORGE_FAIL("training.steps must be > 0, got {}", total_steps);
}

}  // namespace forge
