// One row of exact softmax attention, shared by the training attention (keys in the
// packed qkv tensor) and the decode attention (keys in the KV cache): the kernels differ in
// where key and value j live and which keys a query sees, not in the arithmetic.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/vector_math.h"

namespace forge::cpu {

// o = sum_j softmax_j(scale * q.k_j) v_j over keys j in [first, last], with the row maximum
// subtracted (exponents <= 0) and the sum in double. q and key j have head_dim elements,
// value j and o v_head_dim. key(j) and value(j) point at key and value j; p is scratch of
// at least last + 1 floats. Returns the log-sum-exp of the scaled scores (the training
// attention's lse).
template <class KeyAt, class ValueAt>
double attend_row(float* o, const float* q, int64_t first, int64_t last, float scale, int64_t head_dim,
                  int64_t v_head_dim, float* p, KeyAt key, ValueAt value) {
  float max_score = -INFINITY;
  for (int64_t j = first; j <= last; ++j) {
    p[j] = scale * dot(q, key(j), head_dim);
    max_score = std::max(max_score, p[j]);
  }
  double sum = 0.0;
  for (int64_t j = first; j <= last; ++j) {
    p[j] = std::exp(p[j] - max_score);
    sum += p[j];
  }
  std::fill(o, o + v_head_dim, 0.0f);
  for (int64_t j = first; j <= last; ++j) axpy(o, p[j], value(j), v_head_dim);
  const float inv_sum = static_cast<float>(1.0 / sum);
  for (int64_t e = 0; e < v_head_dim; ++e) o[e] *= inv_sum;
  return max_score + std::log(sum);
}

}  // namespace forge::cpu
