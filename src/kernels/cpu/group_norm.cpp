// GroupNorm (+ SiLU) of NHWC activations on the CPU (ops/group_norm.h). Each (sample, group)
// is one task: the mean over the group's pixels x channels in double, the variance as the
// mean squared deviation from it (two passes: exact for a large mean), then the normalized,
// scaled and shifted values (and SiLU) written in place if out is in. A group's values are
// strided (C / G of every C channels), which costs locality but no correctness; the CPU path
// runs tiny test shapes and the reference. Tasks never share an output element.
#include "kernels/cpu/group_norm.h"

#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {

void group_norm_forward(float* out, const float* in, const float* weight, const float* bias, int64_t batch,
                        int64_t pixels, int64_t channels, int64_t groups, float eps, bool silu) {
  const int64_t width = channels / groups;
  const double count = static_cast<double>(pixels * width);
  parallel_for(batch * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / groups, first = task % groups * width;
      const float* x = in + b * pixels * channels + first;
      float* y = out + b * pixels * channels + first;
      double sum = 0.0;
      for (int64_t p = 0; p < pixels; ++p)
        for (int64_t c = 0; c < width; ++c) sum += x[p * channels + c];
      const double mean = sum / count;
      double squares = 0.0;
      for (int64_t p = 0; p < pixels; ++p)
        for (int64_t c = 0; c < width; ++c) {
          const double d = x[p * channels + c] - mean;
          squares += d * d;
        }
      const double rstd = 1.0 / std::sqrt(squares / count + static_cast<double>(eps));
      for (int64_t p = 0; p < pixels; ++p)
        for (int64_t c = 0; c < width; ++c) {
          const double v = (x[p * channels + c] - mean) * rstd * weight[first + c] + bias[first + c];
          y[p * channels + c] = static_cast<float>(silu ? v / (1.0 + std::exp(-v)) : v);
        }
    }
  });
}

}  // namespace forge::cpu
