#include <gtest/gtest.h>

#include <cmath>

#include "ops/rmsnorm.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

constexpr float kEps = 1e-5f;

TEST(OpsRmsnorm, ForwardMatchesDoublePrecision) {
  Rng rng(21);
  const int64_t shapes[][2] = {{1, 1}, {5, 33}, {3, 64}, {17, 7}};
  for (const auto& s : shapes) {
    int64_t rows = s[0], dim = s[1];
    Tensor x = random_tensor({rows, dim}, rng), w = random_tensor({dim}, rng);
    Tensor y = Tensor::empty({rows, dim}), rstd = Tensor::empty({rows});
    rmsnorm_forward(y, rstd, x, w, kEps);
    std::vector<double> want_y(rows * dim), want_rstd(rows);
    const float* px = x.data<float>();
    for (int64_t n = 0; n < rows; ++n) {
      double ss = 0.0;
      for (int64_t d = 0; d < dim; ++d) ss += static_cast<double>(px[n * dim + d]) * px[n * dim + d];
      want_rstd[n] = 1.0 / std::sqrt(ss / dim + kEps);
      for (int64_t d = 0; d < dim; ++d) want_y[n * dim + d] = px[n * dim + d] * want_rstd[n] * w.data<float>()[d];
    }
    EXPECT_LT(relative_error(y, want_y), 1e-5) << rows << "x" << dim;
    EXPECT_LT(relative_error(rstd, want_rstd), 1e-5) << rows << "x" << dim;
  }
}

TEST(OpsRmsnorm, BackwardAccumulatesFiniteDifferenceGradients) {
  Rng rng(22);
  const int64_t shapes[][2] = {{1, 1}, {4, 9}, {3, 32}};
  for (const auto& s : shapes) {
    int64_t rows = s[0], dim = s[1];
    Tensor x = random_tensor({rows, dim}, rng), w = random_tensor({dim}, rng), r = random_tensor({rows, dim}, rng);
    Tensor y = Tensor::empty({rows, dim}), rstd = Tensor::empty({rows});
    auto loss = [&] {
      rmsnorm_forward(y, rstd, x, w, kEps);
      return testing::weighted_sum(y, r);
    };
    std::vector<double> fd_x = testing::finite_difference(x, loss, 1e-3f);
    std::vector<double> fd_w = testing::finite_difference(w, loss, 1e-3f);
    rmsnorm_forward(y, rstd, x, w, kEps);
    Tensor dx = random_tensor({rows, dim}, rng), dw = random_tensor({dim}, rng);
    std::vector<double> dx_before = testing::to_double(dx), dw_before = testing::to_double(dw);
    rmsnorm_backward(dx, dw, r, x, w, rstd);
    std::vector<double> dx_added = testing::to_double(dx), dw_added = testing::to_double(dw);
    for (size_t i = 0; i < dx_added.size(); ++i) dx_added[i] -= dx_before[i];
    for (size_t i = 0; i < dw_added.size(); ++i) dw_added[i] -= dw_before[i];
    EXPECT_LT(relative_error(dx_added, fd_x), 1e-2) << rows << "x" << dim;
    EXPECT_LT(relative_error(dw_added, fd_w), 1e-2) << rows << "x" << dim;
  }
}

TEST(OpsRmsnorm, IsDeterministic) {
  Rng rng(23);
  int64_t rows = 300, dim = 96;
  Tensor x = random_tensor({rows, dim}, rng), w = random_tensor({dim}, rng), dy = random_tensor({rows, dim}, rng);
  Tensor y = Tensor::empty({rows, dim}), rstd = Tensor::empty({rows});
  rmsnorm_forward(y, rstd, x, w, kEps);
  Tensor dx1 = Tensor::zeros({rows, dim}), dw1 = Tensor::zeros({dim});
  Tensor dx2 = Tensor::zeros({rows, dim}), dw2 = Tensor::zeros({dim});
  rmsnorm_backward(dx1, dw1, dy, x, w, rstd);
  rmsnorm_backward(dx2, dw2, dy, x, w, rstd);
  EXPECT_TRUE(testing::bitwise_equal(dx1, dx2));
  EXPECT_TRUE(testing::bitwise_equal(dw1, dw2));
}

TEST(OpsRmsnorm, RejectsMismatchedWeight) {
  Tensor x = Tensor::zeros({2, 4}), w = Tensor::zeros({5}), y = Tensor::zeros({2, 4}), rstd = Tensor::zeros({2});
  EXPECT_THROW(rmsnorm_forward(y, rstd, x, w, kEps), Error);
}

}  // namespace
}  // namespace forge
