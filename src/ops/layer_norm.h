// LayerNorm with its own scale and bias (PyTorch's nn.LayerNorm with elementwise_affine: the
// norms of CLIP's text encoder), over the last dim of x, forward only:
//   mean[r] = mean_d x[r,d],  rstd[r] = 1 / sqrt(var_d x[r,d] + eps)   (biased variance)
//   y[r,d]  = (x[r,d] - mean[r]) rstd[r] weight[d] + bias[d]
// x and y have any shape whose last dim is D (rows = numel / D); weight and bias are [D].
// CPU: every tensor fp32, the statistics in double. CUDA: x, y, weight, bias bf16, the
// statistics in fp32, D a multiple of 8. y may be x itself.
//
// FLUX's norms have no parameters of their own and are modulated per sample instead
// (ops/modulated_layer_norm.h); this is the plain affine one. No backward: the encoders
// that use it run frozen, for their features.
#pragma once

#include "core/tensor.h"

namespace forge {

void layer_norm_forward(const Tensor& y, const Tensor& x, const Tensor& weight, const Tensor& bias, float eps);

}  // namespace forge
