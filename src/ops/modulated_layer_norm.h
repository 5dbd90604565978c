// LayerNorm without parameters of its own, modulated per sample (the adaLN of diffusion
// transformers: FLUX's norm1/norm2/norm_out, DiT's adaLN-Zero), over the last dim of
// x [B, T, D] with shift and scale [B, D] taken from the timestep's conditioning vector:
//   mean[b,t] = mean_d x,  rstd[b,t] = 1 / sqrt(var_d x + eps)   (biased variance, fp32)
//   y[b,t,d]  = (x[b,t,d] - mean) * rstd * (1 + scale[b,d]) + shift[b,d]
// The backward ACCUMULATES into dx (the residual stream's gradient already holds the skip
// connection's share, as in ops/rmsnorm.h) and OVERWRITES dshift and dscale [B, D]:
//   dshift[b,d] = sum_t dy[b,t,d],  dscale[b,d] = sum_t dy[b,t,d] * xhat[b,t,d]
// CPU: every tensor fp32. CUDA: x, y, dx, dy, shift, scale, dshift, dscale bf16 (the
// sums over t in fp32, rounded once, deterministic), D a multiple of 8; mean and rstd fp32
// [B, T] on both.
#pragma once

#include "core/tensor.h"

namespace forge {

void modulated_layer_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                  const Tensor& shift, const Tensor& scale, float eps);
void modulated_layer_norm_backward(const Tensor& dx, const Tensor& dshift, const Tensor& dscale, const Tensor& dy,
                                   const Tensor& x, const Tensor& scale, const Tensor& mean, const Tensor& rstd);

}  // namespace forge
