#pragma once

#include <cstdint>

namespace forge::cpu {

// out[M, N] = alpha * op(a) @ op(b) + beta * out on dense row-major buffers.
// a is [M, K] ([K, M] when transpose_a), b is [K, N] ([N, K] when transpose_b).
// With beta == 0, out is written without being read.
void matmul(float* out, const float* a, bool transpose_a, const float* b, bool transpose_b, int64_t m, int64_t n,
            int64_t k, float alpha, float beta);

}  // namespace forge::cpu
