// QK RMSNorm and adjacent-pair rotary embeddings for one stream of a joint attention,
// written into its rows of the joint qkv (ops/qk_norm_rope.h), forward and backward.
//
// Forward, per (token, head) row x of a query or key head, with w that head kind's weight
// and (c_i, s_i) the angles of the token's joint position:
//   r = 1 / sqrt(mean(x^2) + eps)     y = x r w     (the sum of squares in double)
//   z[2i] = y[2i] c_i - y[2i+1] s_i    z[2i+1] = y[2i] s_i + y[2i+1] c_i
// value rows are copied. Rows are independent; threads split the tokens.
//
// Backward from g = dL/dz (the stream's rows of dqkv): the rotation is orthogonal, so
//   dy[2i] = g[2i] c_i + g[2i+1] s_i     dy[2i+1] = g[2i+1] c_i - g[2i] s_i
// and then RMSNorm's backward (kernels/cpu/rmsnorm.cpp):
//   dx = r w dy - x r^3 mean(w dy x)     dw += sum over rows of dy x r
// dx is written over dqkv_in (value rows: g itself), token-parallel. The weight gradients
// sum over every token and head of their kind, so threads own disjoint ranges of pairs
// and walk the rows in order (NOTE [Deterministic CPU parallelism]).
#include "kernels/cpu/qk_norm_rope.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

// Element offsets of a stream token's head row in qkv_in and in the joint qkv, and the
// index of its rstd.
struct Rows {
  const QkNormRopeDims& d;
  int64_t stream_row(int64_t n, int64_t head) const { return (n * 3 * d.heads + head) * d.head_dim; }
  int64_t joint_row(int64_t n, int64_t head) const {
    const int64_t b = n / d.stream_seq, t = n % d.stream_seq;
    return ((b * d.seq + d.offset + t) * 3 * d.heads + head) * d.head_dim;
  }
  int64_t rstd_index(int64_t n, int64_t head) const { return n * 2 * d.heads + head; }
  int64_t angle_row(int64_t n) const { return (d.offset + n % d.stream_seq) * (d.head_dim / 2); }
};

int64_t tokens_per_chunk(const QkNormRopeDims& d) {
  return std::max<int64_t>(1, 4096 / std::max<int64_t>(3 * d.heads * d.head_dim, 1));
}

// dy of one pair from g: the inverse rotation.
inline void unrotate(const float* g, float c, float s, float& dy0, float& dy1) {
  dy0 = g[0] * c + g[1] * s;
  dy1 = g[1] * c - g[0] * s;
}

}  // namespace

void qk_norm_rope_forward(float* qkv, float* rstd, const float* qkv_in, const float* q_weight, const float* k_weight,
                          float eps, const float* cos, const float* sin, const QkNormRopeDims& dims) {
  const Rows at{dims};
  const int64_t dim = dims.head_dim, half = dim / 2;
  parallel_for(dims.batch * dims.stream_seq, tokens_per_chunk(dims), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float* c = cos + at.angle_row(n);
      const float* s = sin + at.angle_row(n);
      for (int64_t head = 0; head < 3 * dims.heads; ++head) {
        const float* x = qkv_in + at.stream_row(n, head);
        float* z = qkv + at.joint_row(n, head);
        if (head >= 2 * dims.heads) {
          std::copy_n(x, dim, z);
          continue;
        }
        const float* w = head < dims.heads ? q_weight : k_weight;
        double sum_sq = 0.0;
        for (int64_t e = 0; e < dim; ++e) sum_sq += static_cast<double>(x[e]) * x[e];
        const float r = static_cast<float>(1.0 / std::sqrt(sum_sq / static_cast<double>(dim) + eps));
        rstd[at.rstd_index(n, head)] = r;
        for (int64_t i = 0; i < half; ++i) {
          const float y0 = x[2 * i] * r * w[2 * i], y1 = x[2 * i + 1] * r * w[2 * i + 1];
          z[2 * i] = y0 * c[i] - y1 * s[i];
          z[2 * i + 1] = y0 * s[i] + y1 * c[i];
        }
      }
    }
  });
}

void qk_norm_rope_backward(float* dqkv_in, float* dq_weight, float* dk_weight, const float* dqkv,
                           const float* qkv_in, const float* q_weight, const float* k_weight, const float* rstd,
                           const float* cos, const float* sin, const QkNormRopeDims& dims) {
  const Rows at{dims};
  const int64_t dim = dims.head_dim, half = dim / 2, tokens = dims.batch * dims.stream_seq;
  parallel_for(tokens, tokens_per_chunk(dims), [&](int64_t begin, int64_t end) {
    std::vector<float> dy(static_cast<size_t>(dim));
    for (int64_t n = begin; n < end; ++n) {
      const float* c = cos + at.angle_row(n);
      const float* s = sin + at.angle_row(n);
      for (int64_t head = 0; head < 3 * dims.heads; ++head) {
        const float* g = dqkv + at.joint_row(n, head);
        float* dx = dqkv_in + at.stream_row(n, head);
        if (head >= 2 * dims.heads) {
          std::copy_n(g, dim, dx);
          continue;
        }
        const float* x = qkv_in + at.stream_row(n, head);
        const float* w = head < dims.heads ? q_weight : k_weight;
        double dot = 0.0;
        for (int64_t i = 0; i < half; ++i) {
          unrotate(g + 2 * i, c[i], s[i], dy[2 * i], dy[2 * i + 1]);
          dot += static_cast<double>(dy[2 * i]) * w[2 * i] * x[2 * i] +
                 static_cast<double>(dy[2 * i + 1]) * w[2 * i + 1] * x[2 * i + 1];
        }
        const float r = rstd[at.rstd_index(n, head)];
        const float correction = static_cast<float>(dot / static_cast<double>(dim)) * r * r * r;
        for (int64_t e = 0; e < dim; ++e) dx[e] = r * dy[e] * w[e] - x[e] * correction;
      }
    }
  });
  parallel_for(half, 8, [&](int64_t begin, int64_t end) {
    for (int64_t n = 0; n < tokens; ++n) {
      const float* c = cos + at.angle_row(n);
      const float* s = sin + at.angle_row(n);
      for (int64_t head = 0; head < 2 * dims.heads; ++head) {
        const float* g = dqkv + at.joint_row(n, head);
        const float* x = qkv_in + at.stream_row(n, head);
        const float r = rstd[at.rstd_index(n, head)];
        float* dw = head < dims.heads ? dq_weight : dk_weight;
        for (int64_t i = begin; i < end; ++i) {
          float dy0, dy1;
          unrotate(g + 2 * i, c[i], s[i], dy0, dy1);
          dw[2 * i] += dy0 * x[2 * i] * r;
          dw[2 * i + 1] += dy1 * x[2 * i + 1] * r;
        }
      }
    }
  });
}

}  // namespace forge::cpu
