// Matrix multiply, the CPU reference behind every linear layer.
//
// out = alpha * op(a) @ op(b) + beta * out. Rows of out are independent, so threads split
// them in fixed blocks of four. Each output element is summed over k in float, in an
// order that depends only on the shapes, never on the thread count
// (NOTE [Deterministic CPU parallelism]).
//
// Two loop orders keep the innermost loop on contiguous memory, so the compiler can
// vectorize it without -ffast-math:
//  - b not transposed ([K, N]): the "axpy" form. For each k, row k of b is scaled by
//    a[i, k] and added into an accumulator row. Four rows of out share every load of b.
//  - b transposed ([N, K]): the "dot" form. out[i, j] is the dot product of row i of
//    op(a) and row j of b, both contiguous over K. Eight independent partial sums break
//    the dependency chain of a single accumulator; they are combined in a fixed tree.
//    Four rows of b share every load of a's row. A transposed a is first gathered into
//    a contiguous row.
// The shapes this engine runs on the CPU are small (hidden sizes of a few hundred), so b
// stays in cache and no further tiling pays for itself.
#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/vector_math.h"

namespace forge::cpu {
namespace {

constexpr int64_t kRowBlock = 4;

// Enough multiply-adds per parallel chunk that a thread hand-off is worth it.
int64_t blocks_per_chunk(int64_t n, int64_t k) {
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kRowBlock * n * k));
}

void store_row(float* out_row, const float* acc, int64_t n, float alpha, float beta) {
  if (beta == 0.0f) {
    for (int64_t j = 0; j < n; ++j) out_row[j] = alpha * acc[j];
  } else {
    for (int64_t j = 0; j < n; ++j) out_row[j] = alpha * acc[j] + beta * out_row[j];
  }
}

// acc[r, :] = sum_k a(r, k) * b[k, :] for `rows` rows, a(r, k) = a[r * a_row_step + k * a_k_step].
void accumulate_axpy(float* acc, const float* a, int64_t a_row_step, int64_t a_k_step, int64_t rows,
                     const float* b, int64_t n, int64_t k) {
  std::fill(acc, acc + rows * n, 0.0f);
  if (rows == kRowBlock) {
    float* __restrict c0 = acc;
    float* __restrict c1 = acc + n;
    float* __restrict c2 = acc + 2 * n;
    float* __restrict c3 = acc + 3 * n;
    for (int64_t kk = 0; kk < k; ++kk) {
      const float* a_k = a + kk * a_k_step;
      float a0 = a_k[0], a1 = a_k[a_row_step], a2 = a_k[2 * a_row_step], a3 = a_k[3 * a_row_step];
      const float* __restrict b_row = b + kk * n;
      for (int64_t j = 0; j < n; ++j) {
        float bj = b_row[j];
        c0[j] += a0 * bj;
        c1[j] += a1 * bj;
        c2[j] += a2 * bj;
        c3[j] += a3 * bj;
      }
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* __restrict c = acc + r * n;
    for (int64_t kk = 0; kk < k; ++kk) {
      float ark = a[r * a_row_step + kk * a_k_step];
      const float* __restrict b_row = b + kk * n;
      for (int64_t j = 0; j < n; ++j) c[j] += ark * b_row[j];
    }
  }
}

// dot(x, y_q, n) for the four rows y_q = y + q * y_step, sharing the loads of x. Each
// result is summed exactly as dot() sums it, so it does not matter which path made it.
void dot4(const float* x, const float* y, int64_t y_step, int64_t n, float* result) {
  float s[4][8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int q = 0; q < 4; ++q) {
      const float* yq = y + q * y_step + i;
      for (int r = 0; r < 8; ++r) s[q][r] += x[i + r] * yq[r];
    }
  }
  for (int q = 0; q < 4; ++q) {
    float tail = 0.0f;
    for (int64_t t = i; t < n; ++t) tail += x[t] * y[q * y_step + t];
    result[q] = sum_partials(s[q], tail);
  }
}

void matmul_b_rows(float* out, const float* a, bool transpose_a, const float* b, int64_t m, int64_t n, int64_t k,
                   float alpha, float beta) {
  int64_t a_row_step = transpose_a ? 1 : k;
  int64_t a_k_step = transpose_a ? m : 1;
  int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  parallel_for(blocks, blocks_per_chunk(n, k), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kRowBlock * n);
    for (int64_t blk = begin; blk < end; ++blk) {
      int64_t i0 = blk * kRowBlock, rows = std::min(kRowBlock, m - i0);
      accumulate_axpy(acc.data(), a + i0 * a_row_step, a_row_step, a_k_step, rows, b, n, k);
      for (int64_t r = 0; r < rows; ++r) store_row(out + (i0 + r) * n, acc.data() + r * n, n, alpha, beta);
    }
  });
}

void matmul_b_transposed(float* out, const float* a, bool transpose_a, const float* b, int64_t m, int64_t n,
                         int64_t k, float alpha, float beta) {
  int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
  parallel_for(blocks, blocks_per_chunk(n, k), [&](int64_t begin, int64_t end) {
    std::vector<float> acc(n), a_column(transpose_a ? k : 0);
    for (int64_t i = begin * kRowBlock; i < std::min(m, end * kRowBlock); ++i) {
      const float* a_row = a + i * k;
      if (transpose_a) {
        for (int64_t kk = 0; kk < k; ++kk) a_column[kk] = a[kk * m + i];
        a_row = a_column.data();
      }
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) dot4(a_row, b + j * k, k, k, acc.data() + j);
      for (; j < n; ++j) acc[j] = dot(a_row, b + j * k, k);
      store_row(out + i * n, acc.data(), n, alpha, beta);
    }
  });
}

}  // namespace

void matmul(float* out, const float* a, bool transpose_a, const float* b, bool transpose_b, int64_t m, int64_t n,
            int64_t k, float alpha, float beta) {
  if (transpose_b) {
    matmul_b_transposed(out, a, transpose_a, b, m, n, k, alpha, beta);
  } else {
    matmul_b_rows(out, a, transpose_a, b, m, n, k, alpha, beta);
  }
}

}  // namespace forge::cpu
