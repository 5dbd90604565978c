// One AdamW step (decoupled weight decay, Loshchilov & Hutter), matching torch.optim.AdamW:
//   param *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   param -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// param is fp32 (the master copy), or bf16 when the weights are held only in bf16 (NOTE
// [bf16 master weights] in optim/optimizer.h: the new weights are then rounded
// stochastically, NOTE [Stochastic rounding to bf16] in kernels/stochastic_rounding.h);
// grad fp32, step counts from 1. The moments m, v are fp32, or bf16 on CUDA (NOTE
// [Optimizer state in bf16]).
//
// NOTE [Clipping and the bf16 copy inside AdamW]
// Global-norm clipping scales every gradient by one coefficient before the update; torch
// does it as a separate in-place pass (g *= coef), forge multiplies as it loads g in the
// AdamW pass (the same fp32 product, so the same update) and leaves the gradient buffer
// as it was. When a compute copy is given, the same pass writes the updated weights
// rounded to bf16: the weights the next forward uses. Both save a full pass over every
// parameter per step.
//
// NOTE [AdamW arithmetic as torch does it]
// The hyperparameters are doubles, like the Python floats of a torch param group. The
// per-step scalars (1 - lr * weight_decay, 1 - beta1, lr / (1 - beta1^step), ...) are
// formed in double and rounded to fp32 once; the elementwise work is fp32 in the order of
// torch's single-tensor AdamW (lerp for m, mul + addcmul for v, sqrt / bias + eps, then
// addcdiv), so forge and torch agree to an ulp or two per step.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

struct AdamWHyper {
  double lr = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t step = 1;
  float grad_scale = 1.0f;  // the clip coefficient
  // A bf16 param's stochastic rounding: the seed of its random bits, and the flat index of
  // param's first element (so that the tensors of one model, updated by separate calls,
  // draw separate bits). The step is `step`. Unused for an fp32 param.
  uint64_t rounding_seed = 0;
  int64_t rounding_offset = 0;
};

// compute_copy, when defined: a bf16 tensor of param's shape on CUDA receiving the
// updated weights (none for a bf16 param: it is its own compute copy).
void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWHyper& h,
                  const Tensor& compute_copy = Tensor());

}  // namespace forge
