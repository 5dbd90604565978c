// QK RMSNorm + adjacent-pair rotary embeddings into a stream's rows of the joint qkv
// (ops/qk_norm_rope.h): the forward against the formula in double, the rotation with
// position 0's angles (zero) the identity, the backward against finite differences, at a
// stream placed inside the joint sequence (offset > 0) of a batch of two.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "expect_error.h"
#include "ops/qk_norm_rope.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

constexpr float kEps = 1e-6f;

struct StreamCase {
  int64_t batch, seq, stream_seq, heads, head_dim, offset;
};

std::string describe(const StreamCase& c) {
  return fmt::format("B={} T={} Ts={} H={} D={} offset={}", c.batch, c.seq, c.stream_seq, c.heads, c.head_dim,
                     c.offset);
}

// The stream alone (offset 0, Ts = T), one at the end of the joint sequence, one inside it.
const StreamCase kCases[] = {{1, 5, 5, 1, 4, 0}, {2, 7, 4, 3, 8, 3}, {2, 9, 4, 2, 6, 2}};

// cos, sin [T, D/2] of random angles.
void random_tables(Tensor& cos, Tensor& sin, int64_t seq, int64_t half, Rng& rng) {
  cos = Tensor::empty({seq, half});
  sin = Tensor::empty({seq, half});
  for (int64_t i = 0; i < seq * half; ++i) {
    const double angle = 3.0 * rng.normal();
    cos.data<float>()[i] = static_cast<float>(std::cos(angle));
    sin.data<float>()[i] = static_cast<float>(std::sin(angle));
  }
}

// The joint qkv with the stream's rows written, in double, from the contract's formula;
// every other row keeps `joint`'s values. rstd [B, Ts, 2H].
void direct_formula(const Tensor& joint, const Tensor& qkv_in, const Tensor& q_weight, const Tensor& k_weight,
                    const Tensor& cos, const Tensor& sin, const StreamCase& c, std::vector<double>& want,
                    std::vector<double>& want_rstd) {
  const int64_t heads = 3 * c.heads, d = c.head_dim, half = d / 2;
  want = testing::to_double(joint);
  want_rstd.assign(static_cast<size_t>(c.batch * c.stream_seq * 2 * c.heads), 0.0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t t = 0; t < c.stream_seq; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        const float* x = qkv_in.data<float>() + ((b * c.stream_seq + t) * heads + h) * d;
        double* z = want.data() + ((b * c.seq + c.offset + t) * heads + h) * d;
        if (h >= 2 * c.heads) {
          for (int64_t e = 0; e < d; ++e) z[e] = x[e];
          continue;
        }
        const float* w = (h < c.heads ? q_weight : k_weight).data<float>();
        double ss = 0.0;
        for (int64_t e = 0; e < d; ++e) ss += static_cast<double>(x[e]) * x[e];
        const double r = 1.0 / std::sqrt(ss / static_cast<double>(d) + kEps);
        want_rstd[static_cast<size_t>((b * c.stream_seq + t) * 2 * c.heads + h)] = r;
        for (int64_t i = 0; i < half; ++i) {
          const double a = x[2 * i] * r * w[2 * i], bb = x[2 * i + 1] * r * w[2 * i + 1];
          const double cs = cos.data<float>()[(c.offset + t) * half + i], sn = sin.data<float>()[(c.offset + t) * half + i];
          z[2 * i] = a * cs - bb * sn;
          z[2 * i + 1] = a * sn + bb * cs;
        }
      }
}

TEST(OpsQkNormRope, ForwardMatchesTheFormulaAndLeavesOtherRows) {
  Rng rng(91);
  for (const StreamCase& c : kCases) {
    const int64_t heads = 3 * c.heads;
    Tensor qkv_in = random_tensor({c.batch, c.stream_seq, heads, c.head_dim}, rng, 1.5);
    Tensor q_weight = random_tensor({c.head_dim}, rng), k_weight = random_tensor({c.head_dim}, rng);
    Tensor cos, sin;
    random_tables(cos, sin, c.seq, c.head_dim / 2, rng);
    Tensor qkv = random_tensor({c.batch, c.seq, heads, c.head_dim}, rng);  // the other stream's rows
    const Tensor before = qkv.clone();
    Tensor rstd = Tensor::empty({c.batch, c.stream_seq, 2 * c.heads});
    testing::fill_nan(rstd);
    qk_norm_rope_forward(qkv, rstd, qkv_in, q_weight, k_weight, kEps, cos, sin, c.offset);
    std::vector<double> want, want_rstd;
    direct_formula(before, qkv_in, q_weight, k_weight, cos, sin, c, want, want_rstd);
    EXPECT_LT(relative_error(qkv, want), 1e-6) << describe(c);
    EXPECT_LT(relative_error(rstd, want_rstd), 1e-6) << describe(c);
    // Rows outside [offset, offset + Ts) are exactly as they were.
    const int64_t row = heads * c.head_dim;
    for (int64_t b = 0; b < c.batch; ++b)
      for (int64_t t = 0; t < c.seq; ++t) {
        if (t >= c.offset && t < c.offset + c.stream_seq) continue;
        const int64_t first = (b * c.seq + t) * row;
        for (int64_t e = first; e < first + row; ++e)
          ASSERT_EQ(qkv.data<float>()[e], before.data<float>()[e]) << describe(c) << " b " << b << " t " << t;
      }
  }
}

// Tables of angles t * f_i (as FLUX's positions give them): position 0's angles are zero, so
// the rotation is the identity there and the token's q and k heads are plain RMSNorm, while
// later positions differ from it.
TEST(OpsQkNormRope, PositionZeroAnglesAreTheIdentity) {
  Rng rng(92);
  const StreamCase c{2, 6, 6, 2, 8, 0};
  const int64_t heads = 3 * c.heads, d = c.head_dim, half = d / 2;
  Tensor cos = Tensor::empty({c.seq, half}), sin = Tensor::empty({c.seq, half});
  for (int64_t t = 0; t < c.seq; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(t) * std::pow(10000.0, -2.0 * static_cast<double>(i) / d);
      cos.data<float>()[t * half + i] = static_cast<float>(std::cos(angle));
      sin.data<float>()[t * half + i] = static_cast<float>(std::sin(angle));
    }
  Tensor qkv_in = random_tensor({c.batch, c.seq, heads, d}, rng);
  Tensor q_weight = random_tensor({d}, rng), k_weight = random_tensor({d}, rng);
  Tensor qkv = Tensor::empty({c.batch, c.seq, heads, d}), rstd = Tensor::empty({c.batch, c.seq, 2 * c.heads});
  qk_norm_rope_forward(qkv, rstd, qkv_in, q_weight, k_weight, kEps, cos, sin, 0);
  for (int64_t b = 0; b < c.batch; ++b)
    for (int64_t h = 0; h < 2 * c.heads; ++h) {
      const float* w = (h < c.heads ? q_weight : k_weight).data<float>();
      const float r = rstd.data<float>()[(b * c.seq) * 2 * c.heads + h];
      const float* x0 = qkv_in.data<float>() + ((b * c.seq) * heads + h) * d;
      const float* z0 = qkv.data<float>() + ((b * c.seq) * heads + h) * d;
      for (int64_t e = 0; e < d; ++e) EXPECT_EQ(z0[e], x0[e] * r * w[e]) << "b " << b << " head " << h << " e " << e;
      const float* x1 = qkv_in.data<float>() + ((b * c.seq + 1) * heads + h) * d;
      const float* z1 = qkv.data<float>() + ((b * c.seq + 1) * heads + h) * d;
      const float r1 = rstd.data<float>()[(b * c.seq + 1) * 2 * c.heads + h];
      EXPECT_GT(std::abs(z1[1] - x1[1] * r1 * w[1]), 1e-3f) << "position 1 is rotated";
    }
}

TEST(OpsQkNormRope, BackwardMatchesFiniteDifferences) {
  Rng rng(93);
  for (const StreamCase& c : kCases) {
    const int64_t heads = 3 * c.heads;
    Tensor qkv_in = random_tensor({c.batch, c.stream_seq, heads, c.head_dim}, rng);
    Tensor q_weight = random_tensor({c.head_dim}, rng), k_weight = random_tensor({c.head_dim}, rng);
    Tensor cos, sin;
    random_tables(cos, sin, c.seq, c.head_dim / 2, rng);
    Tensor qkv = Tensor::zeros({c.batch, c.seq, heads, c.head_dim});
    Tensor rstd = Tensor::empty({c.batch, c.stream_seq, 2 * c.heads});
    // L = sum(qkv * R): R covers the whole joint tensor, the other stream's rows too, which
    // the backward must not read into this stream's gradient.
    Tensor r = random_tensor(qkv.shape(), rng);
    auto loss = [&] {
      qk_norm_rope_forward(qkv, rstd, qkv_in, q_weight, k_weight, kEps, cos, sin, c.offset);
      return testing::weighted_sum(qkv, r);
    };
    const std::vector<double> fd_x = testing::finite_difference(qkv_in, loss, 1e-3f);
    const std::vector<double> fd_q = testing::finite_difference(q_weight, loss, 1e-3f);
    const std::vector<double> fd_k = testing::finite_difference(k_weight, loss, 1e-3f);
    loss();
    Tensor dqkv_in = Tensor::empty(qkv_in.shape());
    testing::fill_nan(dqkv_in);  // overwritten
    Tensor dq = random_tensor({c.head_dim}, rng), dk = random_tensor({c.head_dim}, rng);  // accumulated
    std::vector<double> dq_added = testing::to_double(dq), dk_added = testing::to_double(dk);
    qk_norm_rope_backward(dqkv_in, dq, dk, r, qkv_in, q_weight, k_weight, rstd, cos, sin, c.offset);
    for (int64_t e = 0; e < c.head_dim; ++e) {
      dq_added[e] = dq.data<float>()[e] - dq_added[e];
      dk_added[e] = dk.data<float>()[e] - dk_added[e];
    }
    EXPECT_LT(relative_error(dqkv_in, fd_x), 1e-2) << describe(c);
    EXPECT_LT(relative_error(dq_added, fd_q), 1e-2) << describe(c);
    EXPECT_LT(relative_error(dk_added, fd_k), 1e-2) << describe(c);
  }
}

TEST(OpsQkNormRope, ShapeErrorsNameTheOpAndTensor) {
  const StreamCase c{1, 6, 4, 2, 8, 1};
  const Tensor qkv = Tensor::zeros({1, 6, 6, 8}), qkv_in = Tensor::zeros({1, 4, 6, 8});
  const Tensor rstd = Tensor::zeros({1, 4, 4}), w = Tensor::zeros({8}), cos = Tensor::zeros({6, 4});
  auto forward = [&](const Tensor& joint, const Tensor& in, const Tensor& r, const Tensor& table, int64_t offset) {
    qk_norm_rope_forward(joint, r, in, w, w, kEps, table, table, offset);
  };
  EXPECT_NO_THROW(forward(qkv, qkv_in, rstd, cos, c.offset));
  expect_error([&] { forward(qkv, qkv_in, rstd, cos, 3); }, {"qk_norm_rope_forward", "offset 3", "6 tokens"});
  expect_error([&] { forward(Tensor::zeros({1, 6, 5, 8}), qkv_in, rstd, cos, 0); }, {"qk_norm_rope_forward", "qkv"});
  expect_error([&] { forward(qkv, Tensor::zeros({1, 4, 6, 6}), rstd, cos, 0); }, {"qkv_in"});
  expect_error([&] { forward(qkv, qkv_in, Tensor::zeros({1, 4, 6}), cos, 0); }, {"qk_norm_rope_forward rstd"});
  expect_error([&] { forward(qkv, qkv_in, rstd, Tensor::zeros({4, 4}), 0); }, {"cos table"});
  expect_error([&] { forward(qkv_in, qkv_in, rstd, Tensor::zeros({4, 4}), 0); }, {"alias"});
  const Tensor dq = Tensor::zeros({8}), dqkv_in = Tensor::zeros(qkv_in.shape());
  expect_error([&] { qk_norm_rope_backward(dqkv_in, dq, Tensor::zeros({7}), qkv, qkv_in, w, w, rstd, cos, cos, 1); },
               {"qk_norm_rope_backward dk_weight"});
  expect_error([&] { qk_norm_rope_backward(qkv_in, dq, dq, qkv, qkv_in, w, w, rstd, cos, cos, 1); }, {"alias"});
}

}  // namespace
}  // namespace forge
