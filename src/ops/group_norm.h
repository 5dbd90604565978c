// GroupNorm of NHWC activations (NOTE [NHWC activations] in ops/conv2d.h), optionally
// followed by SiLU, forward only: torch.nn.GroupNorm as FLUX's VAE uses it before every
// convolution and its mid-block attention. For each sample b and each of the G groups of
// C / G consecutive channels, over the group's channels at every pixel:
//   mean, var = the mean and the biased variance of x[b, :, c in g]
//   y[b, p, c] = (x[b, p, c] - mean) / sqrt(var + eps) * weight[c] + bias[c]
//   y = y * sigmoid(y)                                              (with `silu`)
// x and y are [B, ..., C] (every dim between the first and the last is pixels); out may be x
// itself. CPU: fp32, statistics in double (two passes: the mean, then the squared deviations
// from it). CUDA: bf16 activations, weight and bias; fp32 statistics (kernels/cuda/group_norm.cu).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

struct GroupNormShape {
  int64_t groups = 32;
  float eps = 1e-6f;
  bool silu = false;
};

void group_norm_forward(const Tensor& out, const Tensor& in, const Tensor& weight, const Tensor& bias,
                        const GroupNormShape& shape);

}  // namespace forge
