// Token embedding: a row gather forward, a row scatter-add backward.
//
// The forward copies table row tokens[n] into out row n, rows split across threads.
// The backward adds dout row n into dtable row tokens[n]. A token that repeats must sum
// its rows in a fixed order, so threads own disjoint ranges of the vocabulary: each scans
// all tokens in order and adds only those in its range. Scanning the token list once per
// thread is cheap next to the row additions, and the result does not depend on the
// thread count (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/embedding.h"

#include <algorithm>

#include "core/parallel.h"

namespace forge::cpu {

void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t count, int64_t hidden) {
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1));
  parallel_for(count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* row = table + static_cast<int64_t>(tokens[n]) * hidden;
      std::copy(row, row + hidden, out + n * hidden);
    }
  });
}

void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t count, int64_t vocab,
                        int64_t hidden) {
  int64_t grain = std::max<int64_t>(1, vocab / 64);
  parallel_for(vocab, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = 0; n < count; ++n) {
      int64_t id = tokens[n];
      if (id < begin || id >= end) continue;
      float* row = dtable + id * hidden;
      const float* d = dout + n * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] += d[h];
    }
  });
}

}  // namespace forge::cpu
