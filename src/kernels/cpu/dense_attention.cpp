// Dense attention on the CPU, the reference the CUDA path is checked against.
//
// One query row at a time: its Lk scores scale * q.k_j + bias[h,i,j] in fp32,
// the row maximum subtracted before exp (exponents <= 0, so nothing overflows),
// the normalizer summed in double, and out = sum_j p_j v_j / sum. Rows (sample,
// head, query) are spread over the thread pool; each row is written by one
// thread, so the result does not depend on the thread count (NOTE
// [Deterministic CPU parallelism]).
#include "kernels/cpu/dense_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/vector_math.h"

namespace forge::cpu {

void dense_attention_forward(float* out, const float* q, const float* k, const float* v, const float* bias,
                             int64_t batch, int64_t q_len, int64_t kv_len, int64_t heads, int64_t head_dim,
                             int64_t v_head_dim, float scale) {
  const int64_t rows = batch * heads * q_len;
  const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(1, kv_len * (head_dim + v_head_dim)));
  parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> p(static_cast<size_t>(kv_len));
    std::vector<double> acc(static_cast<size_t>(v_head_dim));
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row % q_len, h = row / q_len % heads, b = row / q_len / heads;
      const float* qi = q + ((b * q_len + i) * heads + h) * head_dim;
      const float* bias_row = bias ? bias + (h * q_len + i) * kv_len : nullptr;
      float max_score = -INFINITY;
      for (int64_t j = 0; j < kv_len; ++j) {
        const float* kj = k + ((b * kv_len + j) * heads + h) * head_dim;
        p[j] = scale * dot(qi, kj, head_dim) + (bias_row ? bias_row[j] : 0.0f);
        max_score = std::max(max_score, p[j]);
      }
      double sum = 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t j = 0; j < kv_len; ++j) {
        const double e = std::exp(static_cast<double>(p[j]) - max_score);
        sum += e;
        const float* vj = v + ((b * kv_len + j) * heads + h) * v_head_dim;
        for (int64_t d = 0; d < v_head_dim; ++d) acc[d] += e * vj[d];
      }
      float* o = out + ((b * q_len + i) * heads + h) * v_head_dim;
      for (int64_t d = 0; d < v_head_dim; ++d) o[d] = static_cast<float>(acc[d] / sum);
    }
  });
}

}  // namespace forge::cpu
