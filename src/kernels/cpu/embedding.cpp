// Token embedding: a row gather forward, a row scatter-add backward.
//
// The forward copies table row tokens[n] into out row n, rows split across threads.
// The backward adds dout row n into dtable row tokens[n]. A token that repeats must sum
// its rows in a fixed order, so threads own disjoint ranges of the vocabulary: each scans
// all tokens in order and adds only those in its range. Scanning the token list once per
// thread is cheap next to the row additions, and the result does not depend on the
// thread count (NOTE [Deterministic CPU parallelism]).
//
// A table may be one shard of the vocabulary (NOTE [Vocabulary-parallel embedding]): it
// holds the rows [vocab_begin, vocab_begin + rows), an id outside them looks up zeros and
// adds nothing. A whole table is the shard that starts at 0 and holds every row.
#include "kernels/cpu/embedding.h"

#include <algorithm>

#include "core/parallel.h"

namespace forge::cpu {

void embedding_forward(float* out, const int32_t* tokens, const float* table, int64_t count, int64_t vocab_begin,
                       int64_t rows, int64_t hidden) {
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(hidden, 1));
  parallel_for(count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      int64_t row = tokens[n] - vocab_begin;
      float* o = out + n * hidden;
      if (row < 0 || row >= rows) {
        std::fill(o, o + hidden, 0.0f);
        continue;
      }
      std::copy(table + row * hidden, table + (row + 1) * hidden, o);
    }
  });
}

void embedding_backward(float* dtable, const float* dout, const int32_t* tokens, int64_t count, int64_t vocab_begin,
                        int64_t rows, int64_t hidden) {
  int64_t grain = std::max<int64_t>(1, rows / 64);
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = 0; n < count; ++n) {
      int64_t id = tokens[n] - vocab_begin;
      if (id < begin || id >= end) continue;
      float* row = dtable + id * hidden;
      const float* d = dout + n * hidden;
      for (int64_t h = 0; h < hidden; ++h) row[h] += d[h];
    }
  });
}

}  // namespace forge::cpu
