// Rectified-flow training on the CPU (ops/flow_matching.h): the straight path from data to
// noise, x_t = (1 - t) x0 + t noise, whose velocity d x_t / dt = noise - x0 is what the
// model learns to predict, and the mean squared error of that prediction with its gradient.
// The pair is elementwise, split across threads by sample; the loss's sum is one serial
// loop in double, so it is the same whatever the thread count (NOTE [Deterministic CPU
// parallelism]) and a reference for the GPU's fp32 tree of partial sums.
#include "kernels/cpu/flow_matching.h"

#include "core/parallel.h"

namespace forge::cpu {

void flow_matching_pair(float* noisy, float* target, const float* x0, const float* noise, const float* t,
                        int64_t batch, int64_t per_sample) {
  parallel_for(batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float tb = t[b];
      for (int64_t i = b * per_sample; i < (b + 1) * per_sample; ++i) {
        noisy[i] = (1.0f - tb) * x0[i] + tb * noise[i];
        target[i] = noise[i] - x0[i];
      }
    }
  });
}

double mse_loss(float* dpred, const float* pred, const float* target, int64_t n, float scale) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const float d = pred[i] - target[i];
    sum += static_cast<double>(d) * d;
    dpred[i] = scale * d;
  }
  return sum;
}

}  // namespace forge::cpu
