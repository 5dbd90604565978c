// The gated residual add of adaLN-Zero blocks: x[b,t,d] += gate[b,d] y[b,t,d].
//
// Forward and dy = gate dx are row-parallel. dgate[b,d] = sum_t dx y sums over tokens, so
// threads own disjoint ranges of (b, d) and walk t in order, summing in double: no two
// threads touch one element and the order is fixed (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/gated_residual.h"

#include <algorithm>
#include <vector>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

int64_t rows_per_chunk(int64_t dim) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(dim, 1)); }

}  // namespace

void gated_residual_forward(float* out, const float* x, const float* y, const float* gate, int64_t batch,
                            int64_t tokens, int64_t dim) {
  parallel_for(batch * tokens, rows_per_chunk(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* g = gate + row / tokens * dim;
      for (int64_t d = 0; d < dim; ++d) out[row * dim + d] = x[row * dim + d] + g[d] * y[row * dim + d];
    }
  });
}

void gated_residual_backward(float* dy, float* dgate, const float* dx, const float* y, const float* gate,
                             int64_t batch, int64_t tokens, int64_t dim) {
  parallel_for(batch * tokens, rows_per_chunk(dim), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* g = gate + row / tokens * dim;
      for (int64_t d = 0; d < dim; ++d) dy[row * dim + d] = g[d] * dx[row * dim + d];
    }
  });
  parallel_for(batch * dim, 64, [&](int64_t begin, int64_t end) {
    std::vector<double> sums(end - begin, 0.0);
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t at = ((i / dim) * tokens + t) * dim + i % dim;
        sums[i - begin] += static_cast<double>(dx[at]) * y[at];
      }
    }
    for (int64_t i = begin; i < end; ++i) dgate[i] = static_cast<float>(sums[i - begin]);
  });
}

}  // namespace forge::cpu
