// RMSNorm over the last dimension, forward and backward.
//
// Forward, per row: rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * weight. The mean of
// squares is accumulated in double; rstd is kept for the backward.
//
// Backward, with g = dy * weight and r = rstd, the gradient of y = x * r * weight is
//   dx = r * g - x * r^3 * mean(g * x)        dweight = sum over rows of dy * x * r
// Both are ACCUMULATED (see ops/rmsnorm.h). dx is computed row-parallel. dweight sums
// over rows, so threads instead own disjoint column ranges and walk the rows in order:
// no two threads touch one element and the sum order is fixed
// (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/rmsnorm.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

int64_t rows_per_chunk(int64_t dim) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1)); }

}  // namespace

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight, int64_t rows, int64_t dim,
                     float eps) {
  parallel_for(rows, rows_per_chunk(dim), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* xr = x + n * dim;
      double sum_sq = 0.0;
      for (int64_t d = 0; d < dim; ++d) sum_sq += static_cast<double>(xr[d]) * xr[d];
      float r = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(dim) + eps));
      rstd[n] = r;
      float* yr = y + n * dim;
      for (int64_t d = 0; d < dim; ++d) yr[d] = xr[d] * r * weight[d];
    }
  });
}

void rmsnorm_backward(float* dx, float* dweight, const float* dy, const float* x, const float* weight,
                      const float* rstd, int64_t rows, int64_t dim) {
  parallel_for(rows, rows_per_chunk(dim), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* xr = x + n * dim;
      const float* dyr = dy + n * dim;
      double dot = 0.0;
      for (int64_t d = 0; d < dim; ++d) dot += static_cast<double>(dyr[d]) * weight[d] * xr[d];
      float r = rstd[n];
      float correction = static_cast<float>(dot / static_cast<double>(dim)) * r * r * r;
      float* dxr = dx + n * dim;
      for (int64_t d = 0; d < dim; ++d) dxr[d] += r * dyr[d] * weight[d] - xr[d] * correction;
    }
  });
  parallel_for(dim, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = 0; n < rows; ++n) {
      const float* xr = x + n * dim;
      const float* dyr = dy + n * dim;
      float r = rstd[n];
      for (int64_t d = begin; d < end; ++d) dweight[d] += dyr[d] * xr[d] * r;
    }
  });
}

}  // namespace forge::cpu
