#include <gtest/gtest.h>

#include <cmath>
#include <tuple>

#include "expect_error.h"
#include "ops/matmul.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::fill_nan;
using testing::random_tensor;
using testing::relative_error;

// alpha * op(a) @ op(b) + beta * out0, in double.
std::vector<double> naive_matmul(const Tensor& out0, const Tensor& a, bool ta, const Tensor& b, bool tb, double alpha,
                                 double beta) {
  int64_t m = out0.dim(0), n = out0.dim(1), k = ta ? a.dim(0) : a.dim(1);
  const float* pa = a.data<float>();
  const float* pb = b.data<float>();
  const float* po = out0.data<float>();
  std::vector<double> out(m * n);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0.0;
      for (int64_t kk = 0; kk < k; ++kk) {
        double av = ta ? pa[kk * m + i] : pa[i * k + kk];
        double bv = tb ? pb[j * k + kk] : pb[kk * n + j];
        s += av * bv;
      }
      out[i * n + j] = alpha * s + (beta != 0.0 ? beta * po[i * n + j] : 0.0);
    }
  }
  return out;
}

class OpsMatmulShapes : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(OpsMatmulShapes, ForwardMatchesDoublePrecision) {
  auto [ta, tb] = GetParam();
  Rng rng(11);
  const int64_t sizes[][3] = {{1, 1, 1}, {7, 33, 65}, {65, 7, 33}, {33, 65, 7}, {1, 65, 33}, {9, 1, 64}, {66, 17, 1}};
  const float scalars[][2] = {{1.0f, 0.0f}, {0.5f, -1.5f}, {-2.0f, 1.0f}};
  for (const auto& s : sizes) {
    int64_t m = s[0], n = s[1], k = s[2];
    for (const auto& ab : scalars) {
      Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, rng);
      Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, rng);
      Tensor out = random_tensor({m, n}, rng);
      std::vector<double> want = naive_matmul(out, a, ta, b, tb, ab[0], ab[1]);
      matmul(out, a, ta, b, tb, ab[0], ab[1]);
      EXPECT_LT(relative_error(out, want), 1e-5) << "M=" << m << " N=" << n << " K=" << k << " alpha=" << ab[0]
                                                 << " beta=" << ab[1];
    }
  }
}

TEST_P(OpsMatmulShapes, BetaZeroNeverReadsOut) {
  auto [ta, tb] = GetParam();
  Rng rng(12);
  int64_t m = 5, n = 9, k = 13;
  Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, rng);
  Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, rng);
  Tensor out = Tensor::empty({m, n});
  fill_nan(out);
  matmul(out, a, ta, b, tb);
  for (int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data<float>()[i])) << i;
}

TEST_P(OpsMatmulShapes, AddendIsAddedAndLeftAlone) {
  auto [ta, tb] = GetParam();
  Rng rng(13);
  int64_t m = 7, n = 33, k = 65;
  Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, rng);
  Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, rng);
  Tensor addend = random_tensor({m, n}, rng), kept = addend.clone();
  std::vector<double> want = naive_matmul(addend, a, ta, b, tb, 1.0, 1.0);
  Tensor out = Tensor::empty({m, n});
  fill_nan(out);
  matmul_add(out, a, ta, b, tb, addend);
  EXPECT_LT(relative_error(out, want), 1e-5);
  EXPECT_TRUE(bitwise_equal(addend, kept));
  matmul_add(addend, a, ta, b, tb, addend);  // in place
  EXPECT_LT(relative_error(addend, want), 1e-5);
}

TEST_P(OpsMatmulShapes, IsDeterministic) {
  auto [ta, tb] = GetParam();
  Rng rng(13);
  int64_t m = 131, n = 70, k = 97;
  Tensor a = random_tensor(ta ? Shape{k, m} : Shape{m, k}, rng);
  Tensor b = random_tensor(tb ? Shape{n, k} : Shape{k, n}, rng);
  Tensor first = Tensor::empty({m, n}), second = Tensor::empty({m, n});
  matmul(first, a, ta, b, tb);
  matmul(second, a, ta, b, tb);
  EXPECT_TRUE(testing::bitwise_equal(first, second));
}

INSTANTIATE_TEST_SUITE_P(OpsMatmul, OpsMatmulShapes, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "AT" : "A") +
                                  (std::get<1>(info.param) ? "BT" : "B");
                         });

TEST(OpsMatmul, EmptyInnerDimensionScalesOut) {
  Tensor a = Tensor::empty({3, 0}), b = Tensor::empty({0, 4});
  Tensor out = Tensor::empty({3, 4});
  std::fill_n(out.data<float>(), out.numel(), 2.0f);
  matmul(out, a, false, b, false, 1.0f, 0.5f);
  for (int64_t i = 0; i < out.numel(); ++i) EXPECT_EQ(out.data<float>()[i], 1.0f);
}

// The three calls ops/matmul.h documents for a linear layer y = x W^T give the gradients of
// L = sum(y * R) that finite differences see.
TEST(OpsMatmul, LinearLayerBackwardMatchesFiniteDifferences) {
  Rng rng(14);
  int64_t tokens = 7, in = 9, out_features = 5;
  Tensor x = random_tensor({tokens, in}, rng);
  Tensor w = random_tensor({out_features, in}, rng);
  Tensor r = random_tensor({tokens, out_features}, rng);
  Tensor y = Tensor::empty({tokens, out_features});
  auto loss = [&] {
    matmul(y, x, false, w, true);
    return testing::weighted_sum(y, r);
  };
  Tensor dx = Tensor::empty({tokens, in});
  matmul(dx, r, false, w, false);
  Tensor dw = random_tensor({out_features, in}, rng);
  std::vector<double> dw_before = testing::to_double(dw);
  matmul(dw, r, true, x, false, 1.0f, 1.0f);
  std::vector<double> dw_added = testing::to_double(dw);
  for (size_t i = 0; i < dw_added.size(); ++i) dw_added[i] -= dw_before[i];
  EXPECT_LT(relative_error(testing::to_double(dx), testing::finite_difference(x, loss)), 1e-2);
  EXPECT_LT(relative_error(dw_added, testing::finite_difference(w, loss)), 1e-2);
}

// matmul_batched is each matrix's matmul, bit for bit on the CPU, in the three uses of the
// MoE experts (forward, input gradient, weight gradient added); bad shapes are refused.
TEST(OpsMatmul, BatchedIsEachMatrixsProduct) {
  Rng rng(15);
  const int64_t batch = 3, m = 5, n = 4, k = 6;
  for (const bool transpose_a : {false, true})
    for (const bool transpose_b : {false, true}) {
      const Tensor a = random_tensor(transpose_a ? Shape{batch, k, m} : Shape{batch, m, k}, rng);
      const Tensor b = random_tensor(transpose_b ? Shape{batch, n, k} : Shape{batch, k, n}, rng);
      Tensor out = random_tensor({batch, m, n}, rng);
      const Tensor before = out.clone();
      matmul_batched(out, a, transpose_a, b, transpose_b, 0.5f, 1.0f);
      for (int64_t i = 0; i < batch; ++i) {
        Tensor want = before.narrow(i, i + 1).view({m, n}).clone();
        matmul(want, a.narrow(i, i + 1).view(transpose_a ? Shape{k, m} : Shape{m, k}), transpose_a,
               b.narrow(i, i + 1).view(transpose_b ? Shape{n, k} : Shape{k, n}), transpose_b, 0.5f, 1.0f);
        for (int64_t j = 0; j < m * n; ++j)
          EXPECT_EQ(out.data<float>()[i * m * n + j], want.data<float>()[j]) << transpose_a << transpose_b;
      }
    }
  Tensor out = Tensor::zeros({2, 3, 4});
  expect_error([&] { matmul_batched(out, Tensor::zeros({2, 3, 5}), false, Tensor::zeros({3, 5, 4}), false); },
               {"matmul_batched b"});
  expect_error([&] { matmul_batched(out, Tensor::zeros({3, 5}), false, Tensor::zeros({5, 4}), false); },
               {"must be 3-D"});
}

TEST(OpsMatmul, RejectsMismatchedShapes) {
  Tensor a = Tensor::zeros({3, 4}), b = Tensor::zeros({5, 6}), out = Tensor::zeros({3, 6});
  EXPECT_THROW(matmul(out, a, false, b, false), Error);
  EXPECT_THROW(matmul(out, a, true, b, false), Error);
  Tensor ints = Tensor::zeros({4, 6}, DType::I32);
  EXPECT_THROW(matmul(out, a, false, ints, false), Error);
  Tensor right = Tensor::zeros({4, 6});
  EXPECT_THROW(matmul_add(out, a, false, right, false, Tensor::zeros({3, 5})), Error);  // addend shaped unlike out
}

}  // namespace
}  // namespace forge
