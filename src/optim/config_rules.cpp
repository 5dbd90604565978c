// validate() for the optimizer and lr_scheduler sections; see config_rules.h.
#include "optim/config_rules.h"

namespace forge {

void validate(const OptimizerConfig& opt, const LRSchedulerConfig& sched, int64_t total_steps,
              const KeyDescriber& keys) {
  check_choice(keys, "optimizer.name", opt.name, optim_bounds::optimizer_names);
  check_range(keys, "optimizer.lr", opt.lr, optim_bounds::lr);
  check_range(keys, "optimizer.beta1", opt.beta1, optim_bounds::beta);
  check_range(keys, "optimizer.beta2", opt.beta2, optim_bounds::beta);
  check_range(keys, "optimizer.eps", opt.eps, optim_bounds::eps);
  check_range(keys, "optimizer.weight_decay", opt.weight_decay, optim_bounds::weight_decay);
  check_choice(keys, "optimizer.state_dtype", opt.state_dtype, optim_bounds::state_dtypes);
  check_choice(keys, "optimizer.master_dtype", opt.master_dtype, optim_bounds::master_dtypes);

  check_range(keys, "lr_scheduler.warmup_steps", sched.warmup_steps, optim_bounds::warmup_steps);
  check_choice(keys, "lr_scheduler.decay_style", sched.decay_style, optim_bounds::decay_styles);
  check_range(keys, "lr_scheduler.decay_steps", sched.decay_steps, optim_bounds::decay_steps);
  check_range(keys, "lr_scheduler.min_lr", sched.min_lr, optim_bounds::min_lr);
  if (sched.min_lr > opt.lr)
    FORGE_FAIL("{} must not exceed {}", keys.describe("lr_scheduler.min_lr", sched.min_lr),
               keys.describe("optimizer.lr", opt.lr));

  check_range(keys, "training.steps", total_steps, optim_bounds::total_steps);
}

}  // namespace forge
