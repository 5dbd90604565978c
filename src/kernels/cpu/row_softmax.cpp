// Row softmax on the CPU: per row the maximum, the sum of exp(x - max) in double, then the
// quotients; rows are split across threads.
#include "kernels/cpu/row_softmax.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {

void row_softmax(float* probs, const float* scores, int64_t rows, int64_t cols) {
  parallel_for(rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, cols)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = scores + r * cols;
      float* y = probs + r * cols;
      const float top = *std::max_element(x, x + cols);
      double sum = 0.0;
      for (int64_t j = 0; j < cols; ++j) sum += std::exp(static_cast<double>(x[j]) - top);
      for (int64_t j = 0; j < cols; ++j) y[j] = static_cast<float>(std::exp(static_cast<double>(x[j]) - top) / sum);
    }
  });
}

}  // namespace forge::cpu
