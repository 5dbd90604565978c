// Softmax cross-entropy with its gradient, one row of logits at a time.
//
// Per row: m = max(x), lse = m + log(sum exp(x - m)) (the max keeps every exponent <= 0,
// so nothing overflows; the sum runs in double), loss = lse - x[target], and
//   dlogits = grad_scale * (exp(x - lse) - onehot(target)).
// The row is fully read (max, sum, x[target]) before any gradient is written, which is what
// lets dlogits alias logits. Ignored rows get loss 0 and, when asked, a zero gradient.
// Rows are independent and split across threads.
#include "kernels/cpu/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {

void cross_entropy_forward_backward(float* losses, float* dlogits, const float* logits, const int32_t* targets,
                                    int64_t rows, int64_t vocab, int32_t ignore_index, float grad_scale) {
  int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(vocab, 1));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = logits + n * vocab;
      float* dx = dlogits ? dlogits + n * vocab : nullptr;
      int32_t target = targets[n];
      if (target == ignore_index) {
        losses[n] = 0.0f;
        if (dx) std::fill(dx, dx + vocab, 0.0f);
        continue;
      }
      float max_logit = *std::max_element(x, x + vocab);
      double sum_exp = 0.0;
      for (int64_t v = 0; v < vocab; ++v) sum_exp += std::exp(x[v] - max_logit);
      double lse = max_logit + std::log(sum_exp);
      losses[n] = static_cast<float>(lse - x[target]);
      if (!dx) continue;
      float lse_f = static_cast<float>(lse);
      for (int64_t v = 0; v < vocab; ++v) dx[v] = grad_scale * std::exp(x[v] - lse_f);
      dx[target] -= grad_scale;
    }
  });
}

}  // namespace forge::cpu
