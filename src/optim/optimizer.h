// The optimizer layer: AdamW over a list of fp32 parameter tensors, LR schedules, and
// global grad-norm clipping. Hyperparameters follow torch.optim.AdamW and torchtitan's
// lr_scheduler section.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace forge {

struct OptimizerConfig {
  std::string name = "adamw";
  double lr = 3e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

struct LRSchedulerConfig {
  int64_t warmup_steps = 0;
  std::string decay_style = "cosine";  // cosine | linear | constant
  int64_t decay_steps = 0;             // steps of decay after warm-up; 0: until training ends
  double min_lr = 0.0;                 // floor reached at the end of decay
};

// Learning rate for optimizer step `step` (0-based) of a run with `total_steps` steps.
double lr_at(const OptimizerConfig& opt, const LRSchedulerConfig& sched, int64_t step, int64_t total_steps);

// Scales grads in place so their global L2 norm is at most max_norm (no-op if max_norm <= 0).
// Returns the norm before clipping.
double clip_grad_norm(const std::vector<Tensor>& grads, double max_norm);

class AdamW {
 public:
  // decay[i]: whether params[i] gets weight decay (the model excludes norm weights).
  AdamW(const OptimizerConfig& config, std::vector<Tensor> params, std::vector<bool> decay);
  // One step with the given learning rate; grads align with params.
  void step(const std::vector<Tensor>& grads, double lr);
  int64_t step_count() const { return step_; }
  // Optimizer state, for checkpoints: m and v per parameter.
  const std::vector<Tensor>& exp_avg() const { return m_; }
  const std::vector<Tensor>& exp_avg_sq() const { return v_; }
  void set_step_count(int64_t step) { step_ = step; }

 private:
  OptimizerConfig config_;
  std::vector<Tensor> params_;
  std::vector<bool> decay_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
};

}  // namespace forge
