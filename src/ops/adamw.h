// One AdamW step (decoupled weight decay, Loshchilov & Hutter), matching torch.optim.AdamW:
//   param *= 1 - lr * weight_decay
//   m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
//   param -= lr * (m / (1 - beta1^step)) / (sqrt(v / (1 - beta2^step)) + eps)
// param, m, v are fp32 (the master copy); grad is fp32. step counts from 1.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

struct AdamWHyper {
  float lr = 0.0f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  int64_t step = 1;
};

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWHyper& h);

}  // namespace forge
