// One AdamW step (decoupled weight decay, Loshchilov & Hutter), matching torch.optim.AdamW:
//   param *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   param -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// param, m, v are fp32 (the master copy); grad is fp32. step counts from 1.
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
};

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWHyper& h);

}  // namespace forge
