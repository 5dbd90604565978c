// A bias added to every row of an activation [N, F], and its gradient: what the linear ops
// do for a layer with a bias (NOTE [Linear bias] in ops/linear.h).
//   add_bias        y[n, f] += bias[f]
//   bias_gradient   grad[f] = sum_n dy[n, f]   (written over grad with `overwrite`, else added)
// CPU: every tensor fp32. CUDA: y, bias and dy bf16, grad fp32 (the sums in fp32, in a fixed
// order: the same bits on every run).
#pragma once

#include "core/tensor.h"

namespace forge {

void add_bias(const Tensor& y, const Tensor& bias);
void bias_gradient(const Tensor& grad_bias, const Tensor& dy, bool overwrite);

}  // namespace forge
