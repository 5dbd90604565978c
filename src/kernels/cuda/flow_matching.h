#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// x0, noise, noisy and target are [batch, per_sample] fp32 or bf16 (all alike), t is fp32
// [batch]: noisy = (1 - t) x0 + t noise, target = noise - x0, computed in fp32.
void flow_matching_pair(float* noisy, float* target, const float* x0, const float* noise, const float* t,
                        int64_t batch, int64_t per_sample);
void flow_matching_pair(bf16* noisy, bf16* target, const bf16* x0, const bf16* noise, const float* t,
                        int64_t batch, int64_t per_sample);
// Over n elements (pred, target and dpred alike): dpred = scale (pred - target) and
// loss[0] += inv_count sum (pred - target)^2, the sum in fp32 in an order fixed by n alone.
void mse_loss(float* loss, float* dpred, const float* pred, const float* target, int64_t n, float scale,
              float inv_count);
void mse_loss(float* loss, bf16* dpred, const bf16* pred, const bf16* target, int64_t n, float scale,
              float inv_count);

}  // namespace forge::cuda
