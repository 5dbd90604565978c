// Affine LayerNorm, forward, per row: the mean, then the biased variance as the mean of
// squared deviations from it (two passes, both in double, so a large mean costs no
// precision); y = (x - mean) rstd weight + bias with rstd = 1 / sqrt(var + eps). Rows are
// split across threads; each row is read into its statistics before y overwrites it, so y
// may be x.
#include "kernels/cpu/layer_norm.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {

void layer_norm_forward(float* y, const float* x, const float* weight, const float* bias, int64_t rows, int64_t dim,
                        float eps) {
  const int64_t rows_per_chunk = std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1));
  parallel_for(rows, rows_per_chunk, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* xr = x + row * dim;
      double sum = 0.0;
      for (int64_t d = 0; d < dim; ++d) sum += xr[d];
      const double mean = sum / static_cast<double>(dim);
      double squares = 0.0;
      for (int64_t d = 0; d < dim; ++d) squares += (xr[d] - mean) * (xr[d] - mean);
      const double rstd = 1.0 / std::sqrt(squares / static_cast<double>(dim) + eps);
      float* yr = y + row * dim;
      for (int64_t d = 0; d < dim; ++d)
        yr[d] = static_cast<float>((xr[d] - mean) * rstd * weight[d] + bias[d]);
    }
  });
}

}  // namespace forge::cpu
