// Softmax cross-entropy over one shard of the vocabulary, in the three phases of NOTE
// [Vocabulary-parallel cross-entropy], one row at a time, rows split across threads.
//
// The arithmetic is kernels/cpu/cross_entropy.cpp's, spread over the phases: the max is
// taken in fp32, the sum of exp(x - m) runs in double over the shard (the caller adds the
// shards' sums in fp32), lse = m + log(sum) in double, loss = lse - x[target], and the
// gradient grad_scale * exp(x - lse) with lse rounded to fp32, less grad_scale at the
// target. Each shard's sum is rounded to fp32 once before the all-reduce, so the loss
// differs from the unsharded one by about fp32's rounding of the sum (1e-7 relative).
// The finish reads the row only to write its gradient, element by element, which is what
// lets dlogits alias logits. Ignored rows are never read: their sums, loss and gradient
// are zeros.
#include "kernels/cpu/vocab_parallel_cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

int64_t grain_for(int64_t vocab) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(vocab, 1)); }

// The target's column in the shard, or -1 when the shard does not hold it.
int64_t local_target(int32_t target, int64_t vocab_begin, int64_t vocab) {
  int64_t column = target - vocab_begin;
  return column >= 0 && column < vocab ? column : -1;
}

}  // namespace

void vocab_parallel_cross_entropy_max(float* row_max, const float* logits, int64_t rows, int64_t vocab) {
  parallel_for(rows, grain_for(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) row_max[n] = *std::max_element(logits + n * vocab, logits + (n + 1) * vocab);
  });
}

void vocab_parallel_cross_entropy_sums(float* sums, const float* logits, const float* row_max,
                                       const int32_t* targets, int64_t rows, int64_t vocab, int64_t vocab_begin,
                                       int32_t ignore_index) {
  parallel_for(rows, grain_for(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      sums[n] = sums[rows + n] = 0.0f;
      if (targets[n] == ignore_index) continue;
      const float* x = logits + n * vocab;
      double sum_exp = 0.0;
      for (int64_t v = 0; v < vocab; ++v) sum_exp += std::exp(x[v] - row_max[n]);
      sums[n] = static_cast<float>(sum_exp);
      int64_t target = local_target(targets[n], vocab_begin, vocab);
      if (target >= 0) sums[rows + n] = x[target];
    }
  });
}

void vocab_parallel_cross_entropy_finish(float* losses, float* dlogits, const float* logits, const float* row_max,
                                         const float* sums, const int32_t* targets, int64_t rows, int64_t vocab,
                                         int64_t vocab_begin, int32_t ignore_index, float grad_scale) {
  parallel_for(rows, grain_for(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* x = logits + n * vocab;
      float* dx = dlogits ? dlogits + n * vocab : nullptr;
      if (targets[n] == ignore_index) {
        losses[n] = 0.0f;
        if (dx) std::fill(dx, dx + vocab, 0.0f);
        continue;
      }
      double lse = row_max[n] + std::log(static_cast<double>(sums[n]));
      losses[n] = static_cast<float>(lse - sums[rows + n]);
      if (!dx) continue;
      float lse_f = static_cast<float>(lse);
      for (int64_t v = 0; v < vocab; ++v) dx[v] = grad_scale * std::exp(x[v] - lse_f);
      int64_t target = local_target(targets[n], vocab_begin, vocab);
      if (target >= 0) dx[target] -= grad_scale;
    }
  });
}

}  // namespace forge::cpu
