// LayerNorm without affine parameters, modulated per sample by shift and scale (adaLN).
//
// Forward, per row (b, t): the mean, then the biased variance as the mean of squared
// deviations from it (two passes, both in double, so a large mean costs no precision);
// rstd = 1 / sqrt(var + eps), xhat = (x - mean) rstd, y = xhat (1 + scale[b]) + shift[b].
// mean and rstd are kept for the backward.
//
// Backward, with g = dy (1 + scale[b]) the gradient reaching xhat, the LayerNorm rule
//   dx = rstd (g - mean_d(g) - xhat mean_d(g xhat))                      (ACCUMULATED)
//   dshift[b,d] = sum_t dy,  dscale[b,d] = sum_t dy xhat                   (overwritten)
// dx is computed row-parallel with its row sums in double. The sums over t run with
// threads owning disjoint ranges of (b, d) and walking t in order, in double: no two
// threads touch one element and the order is fixed (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/modulated_layer_norm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

int64_t rows_per_chunk(int64_t dim) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1)); }

}  // namespace

void modulated_layer_norm_forward(float* y, float* mean, float* rstd, const float* x, const float* shift,
                                  const float* scale, int64_t batch, int64_t tokens, int64_t dim, float eps) {
  parallel_for(batch * tokens, rows_per_chunk(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = x + row * dim;
      double sum = 0.0;
      for (int64_t d = 0; d < dim; ++d) sum += xr[d];
      const double m = sum / static_cast<double>(dim);
      double squares = 0.0;
      for (int64_t d = 0; d < dim; ++d) squares += (xr[d] - m) * (xr[d] - m);
      const float mf = static_cast<float>(m);
      const float r = static_cast<float>(1.0 / std::sqrt(squares / static_cast<double>(dim) + eps));
      mean[row] = mf;
      rstd[row] = r;
      const int64_t b = row / tokens;
      const float* sh = shift + b * dim;
      const float* sc = scale + b * dim;
      float* yr = y + row * dim;
      for (int64_t d = 0; d < dim; ++d) yr[d] = (xr[d] - mf) * r * (1.0f + sc[d]) + sh[d];
    }
  });
}

void modulated_layer_norm_backward(float* dx, float* dshift, float* dscale, const float* dy, const float* x,
                                   const float* scale, const float* mean, const float* rstd, int64_t batch,
                                   int64_t tokens, int64_t dim) {
  parallel_for(batch * tokens, rows_per_chunk(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = x + row * dim;
      const float* dyr = dy + row * dim;
      const float* sc = scale + row / tokens * dim;
      const float m = mean[row], r = rstd[row];
      double sum_g = 0.0, sum_gx = 0.0;
      for (int64_t d = 0; d < dim; ++d) {
        const double g = static_cast<double>(dyr[d]) * (1.0f + sc[d]);
        sum_g += g;
        sum_gx += g * ((xr[d] - m) * r);
      }
      const float mean_g = static_cast<float>(sum_g / static_cast<double>(dim));
      const float mean_gx = static_cast<float>(sum_gx / static_cast<double>(dim));
      float* dxr = dx + row * dim;
      for (int64_t d = 0; d < dim; ++d) {
        const float xhat = (xr[d] - m) * r;
        dxr[d] += r * (dyr[d] * (1.0f + sc[d]) - mean_g - xhat * mean_gx);
      }
    }
  });
  parallel_for(batch * dim, 64, [&](int64_t begin, int64_t end) {
    std::vector<double> sum_dy(end - begin, 0.0), sum_dyx(end - begin, 0.0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / dim, d = i % dim, row = b * tokens + t;
        const float g = dy[row * dim + d];
        sum_dy[i - begin] += g;
        sum_dyx[i - begin] += static_cast<double>(g) * ((x[row * dim + d] - mean[row]) * rstd[row]);
      }
    }
    for (int64_t i = begin; i < end; ++i) {
      dshift[i] = static_cast<float>(sum_dy[i - begin]);
      dscale[i] = static_cast<float>(sum_dyx[i - begin]);
    }
  });
}

}  // namespace forge::cpu
