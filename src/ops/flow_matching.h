// Rectified-flow (flow matching) training on tokens of clean latents x0 [B, N, F] with noise
// of the same shape and each sample's time t [B] (fp32, in [0, 1], on the tensors' device):
//   flow_matching_pair:  noisy  = (1 - t) x0 + t noise      (the model's input x_t)
//                        target = noise - x0                (the velocity it predicts)
//   mse_loss:            loss  += sum (pred - target)^2 / count      (fp32 [1], added to)
//                        dpred  = 2 (pred - target) / count * grad_scale   (overwritten)
// count is pred's element count; grad_scale (1 / accumulation steps) scales only the
// gradient, so the loss stays the mean of the micro-batch and sums over a step's
// micro-batches. CPU fp32; CUDA x0, noise, noisy, target, pred, dpred fp32 or bf16 (each
// pair of the same op of one dtype), the loss's sum in fp32.
#pragma once

#include "core/tensor.h"

namespace forge {

void flow_matching_pair(const Tensor& noisy, const Tensor& target, const Tensor& x0, const Tensor& noise,
                        const Tensor& t);
void mse_loss(const Tensor& loss, const Tensor& dpred, const Tensor& pred, const Tensor& target, float grad_scale);

}  // namespace forge
