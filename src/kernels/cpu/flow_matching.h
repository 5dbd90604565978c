#pragma once

#include <cstdint>

namespace forge::cpu {

// x0, noise, noisy and target are [batch, per_sample], t is [batch]:
//   noisy = (1 - t) x0 + t noise, target = noise - x0.
void flow_matching_pair(float* noisy, float* target, const float* x0, const float* noise, const float* t,
                        int64_t batch, int64_t per_sample);
// dpred = scale (pred - target) over n elements; returns sum (pred - target)^2, in double.
double mse_loss(float* dpred, const float* pred, const float* target, int64_t n, float scale);

}  // namespace forge::cpu
