// Small inner loops shared by the CPU kernels, written so the compiler vectorizes them
// without -ffast-math.
#pragma once

#include <cstdint>

namespace forge::cpu {

// The fixed summation tree that finishes a dot product from eight partial sums and a tail.
inline float sum_partials(const float* s, float tail) {
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7])) + tail;
}

// Dot product of two contiguous vectors. Eight independent partial sums (combined in a
// fixed tree) break the dependency chain of a single accumulator, so the loop vectorizes;
// the result depends only on n, never on threading.
inline float dot(const float* x, const float* y, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int r = 0; r < 8; ++r) s[r] += x[i + r] * y[i + r];
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += x[i] * y[i];
  return sum_partials(s, tail);
}

// y += a * x over contiguous vectors.
inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

}  // namespace forge::cpu
