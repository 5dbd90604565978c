// The optimizer layer: AdamW over a list of fp32 parameter tensors, LR schedules, and
// global grad-norm clipping (the rules its config sections must satisfy are in
// optim/config_rules.h). Hyperparameters follow torch.optim.AdamW and torchtitan's
// lr_scheduler section; tests/python/test_optim_vs_torch.py holds all three to PyTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace forge {

struct OptimizerConfig {
  std::string name = "adamw";
  double lr = 5e-3;  // the default suits the debug-tiny run; real experiments set their own
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  std::string state_dtype = "fp32";  // fp32 | bf16: storage of AdamW's moments (NOTE [Optimizer state in bf16])
  std::string master_dtype = "fp32";  // fp32 | bf16: the weights' one copy (NOTE [bf16 master weights])
};

struct LRSchedulerConfig {
  int64_t warmup_steps = 20;
  std::string decay_style = "cosine";  // cosine | linear | constant
  int64_t decay_steps = 0;             // steps of decay after warm-up; 0: until training ends
  double min_lr = 0.0;                 // floor reached at the end of decay
};

// NOTE [LR schedule]
// Learning rate for optimizer step `step` (0-based: step 0 is the first update) of a run
// with `total_steps` steps. With W = warmup_steps, D = decay_steps (0: total_steps - W),
// peak = opt.lr and t = step - W:
//   warm-up, step < W:  peak * (step + 1) / (W + 1)      (torchtitan's linear warm-up: it
//                       never uses lr 0 and reaches peak on the first step after it)
//   cosine, t < D:      min_lr + (peak - min_lr) * (1 + cos(pi * t / D)) / 2
//   linear, t < D:      peak * (1 + (min_lr / peak - 1) * t / D)
//   constant:           peak
//   cosine/linear, t >= D: min_lr, held to the end.
// In PyTorch terms: step i uses the lr that SequentialLR([LambdaLR(warm-up factor),
// CosineAnnealingLR(T_max=D, eta_min=min_lr) | LinearLR(1, min_lr/peak, total_iters=D) |
// LambdaLR(1), LambdaLR(min_lr/peak)], milestones=[W, W + D]) holds after i scheduler
// steps; the decay formulas are those schedulers' closed forms.
double lr_at(const OptimizerConfig& opt, const LRSchedulerConfig& sched, int64_t step, int64_t total_steps);

// Global-norm clipping as torch.nn.utils.clip_grad_norm_ does it, in two halves: the
// global L2 norm of all grads (accumulated in double), and the coefficient every grad is
// scaled by, max_norm / (norm + 1e-6) formed in fp32 as torch forms it, or 1 when
// max_norm is 0, the coefficient is >= 1, or the norm is not finite (the trainer reports
// that and stops). The scaling itself happens inside AdamW::step (NOTE [Clipping and the
// bf16 copy inside AdamW] in ops/adamw.h).
double global_grad_norm(const std::vector<Tensor>& grads);
float clip_coefficient(double norm, double max_norm);

// NOTE [Optimizer state in bf16]
// optimizer.state_dtype bf16 stores AdamW's two moments in bf16 (CUDA only), as
// Megatron-LM's --exp-avg-dtype/--exp-avg-sq-dtype bf16 do: the update is computed in
// fp32 and the new moments rounded to nearest. It halves the optimizer state (8 to 4
// bytes per parameter), the memory economy that lets the full Llama 3.1 8B train on one
// 141 GB H200. The master weights stay fp32.
//
// NOTE [bf16 master weights]
// optimizer.master_dtype bf16 keeps no fp32 master copy: the weights are held once, in
// bf16, and are what the forward reads; AdamW widens each weight, computes the update in
// fp32 as before and rounds the new weight stochastically (NOTE [Stochastic rounding to
// bf16] in kernels/stochastic_rounding.h), so that updates far below a bf16 ulp still move
// the weights in expectation. torchao's AdamW with bf16_stochastic_round=True and the FLUX
// fine-tuning tools that train "full bf16" do the same. With bf16 moments it takes a weight
// from 18 bytes (fp32 master, bf16 compute copy, fp32 gradient, fp32 m and v) to 10 (bf16
// weight, fp32 gradient, bf16 m and v): the economy that lets the 12B FLUX.1-dev fine-tune
// on one 141 GB H200 (NOTE [FLUX runs] in train/flux_trainer.h). The bits of the rounding
// are a pure function of (training.seed, step, the weight's flat index), so a resumed run
// rounds as the uninterrupted one, and a checkpoint stores the bf16 weights widened to fp32
// (exactly): a run with fp32 masters can start from it, and one with bf16 weights from an
// fp32 checkpoint (rounded to nearest once, at load). FLUX runs on one device take it (on
// the CPU reference too, whose compute copy is then the bf16 weights widened to fp32); the
// language models' trainer and FSDP's sharded master chunks keep fp32.

class AdamW {
 public:
  // decay[i]: whether params[i] gets weight decay (the model excludes norm weights).
  // The moments start at zero, in config.state_dtype; the first step() is step 1.
  AdamW(const OptimizerConfig& config, std::vector<Tensor> params, std::vector<bool> decay);
  // One step with the given learning rate; grads align with params, each scaled by
  // grad_scale (the clip coefficient) as it is read. compute_copies, when not empty,
  // align with params and receive the updated weights in bf16.
  void step(const std::vector<Tensor>& grads, double lr, float grad_scale = 1.0f,
            const std::vector<Tensor>& compute_copies = {});
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
