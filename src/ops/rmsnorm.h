// RMSNorm over the last dimension of x [N, D]:
//   rstd[n] = 1 / sqrt(mean_d(x[n,d]^2) + eps),  y[n,d] = x[n,d] * rstd[n] * weight[d]
// The backward ACCUMULATES into dx and dweight (dx += ..., dweight += ...): dx is the
// residual stream's gradient, which already holds the skip connection's share, and
// dweight sums over micro-batches.
#pragma once

#include "core/tensor.h"

namespace forge {

struct LinearWeight;  // ops/linear.h

// `feeds`: the projection that reads y next, if any; an FP8 one gets y's amax (or codes)
// from this pass (NOTE [FP8 fused producers] in ops/fp8_linear.h). y is the same either way.
void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps,
                     const LinearWeight* feeds = nullptr);
void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd);

}  // namespace forge
