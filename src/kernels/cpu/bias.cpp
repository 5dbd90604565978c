// A bias added to every row, and its gradient, the column sums of dy (ops/bias.h).
// The forward splits rows across threads. The column sums split the columns instead: each
// thread owns a range of them and walks every row in order, summing in double, so no two
// threads touch one element and the order of the sum is fixed
// (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/bias.h"

#include <algorithm>
#include <vector>

#include "core/parallel.h"

namespace forge::cpu {

void add_bias(float* y, const float* bias, int64_t rows, int64_t features) {
  parallel_for(rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(features, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float* row = y + n * features;
      for (int64_t f = 0; f < features; ++f) row[f] += bias[f];
    }
  });
}

void bias_gradient(float* grad, const float* dy, int64_t rows, int64_t features, bool overwrite) {
  parallel_for(features, 16, [&](int64_t begin, int64_t end) {
    std::vector<double> sums(static_cast<size_t>(end - begin), 0.0);
    for (int64_t n = 0; n < rows; ++n) {
      const float* row = dy + n * features;
      for (int64_t f = begin; f < end; ++f) sums[static_cast<size_t>(f - begin)] += row[f];
    }
    for (int64_t f = begin; f < end; ++f)
      grad[f] = static_cast<float>(sums[static_cast<size_t>(f - begin)] + (overwrite ? 0.0 : grad[f]));
  });
}

}  // namespace forge::cpu
