#include <gtest/gtest.h>

#include <cmath>

#include "expect_error.h"
#include "ops/modulated_layer_norm.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

constexpr float kEps = 1e-6f;  // FLUX's

struct Dims {
  int64_t batch, tokens, dim;
};

// x drawn around `offset`, so the mean matters; shift and scale as a conditioning
// projection gives them.
struct Inputs {
  Tensor x, shift, scale;
  Inputs(const Dims& s, Rng& rng, float offset) {
    x = random_tensor({s.batch, s.tokens, s.dim}, rng);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += offset;
    shift = random_tensor({s.batch, s.dim}, rng, 0.5);
    scale = random_tensor({s.batch, s.dim}, rng, 0.5);
  }
};

TEST(OpsModulatedLayerNorm, ForwardMatchesDoublePrecision) {
  Rng rng(41);
  for (const Dims& s : {Dims{1, 1, 1}, Dims{1, 1, 5}, Dims{2, 3, 7}, Dims{3, 4, 64}}) {
    Inputs in(s, rng, 50.0f);
    Tensor y = Tensor::empty({s.batch, s.tokens, s.dim});
    Tensor mean = Tensor::empty({s.batch, s.tokens}), rstd = Tensor::empty({s.batch, s.tokens});
    modulated_layer_norm_forward(y, mean, rstd, in.x, in.shift, in.scale, kEps);
    std::vector<double> want_y(y.numel()), want_mean(mean.numel()), want_rstd(rstd.numel());
    const float* px = in.x.data<float>();
    for (int64_t row = 0; row < s.batch * s.tokens; ++row) {
      const float* xr = px + row * s.dim;
      double sum = 0.0, squares = 0.0;
      for (int64_t d = 0; d < s.dim; ++d) sum += xr[d];
      const double m = sum / s.dim;
      for (int64_t d = 0; d < s.dim; ++d) squares += (xr[d] - m) * (xr[d] - m);
      want_mean[row] = m;
      want_rstd[row] = 1.0 / std::sqrt(squares / s.dim + kEps);
      const int64_t b = row / s.tokens;
      for (int64_t d = 0; d < s.dim; ++d)
        want_y[row * s.dim + d] = (xr[d] - m) * want_rstd[row] * (1.0 + in.scale.data<float>()[b * s.dim + d]) +
                                  in.shift.data<float>()[b * s.dim + d];
    }
    const std::string at = std::to_string(s.batch) + "x" + std::to_string(s.tokens) + "x" + std::to_string(s.dim);
    EXPECT_LT(relative_error(y, want_y), 1e-5) << at;
    EXPECT_LT(relative_error(mean, want_mean), 1e-6) << at;
    EXPECT_LT(relative_error(rstd, want_rstd), 1e-5) << at;
  }
}

// A constant row normalizes to zero: y is the shift alone (rstd = 1 / sqrt(eps)).
TEST(OpsModulatedLayerNorm, ConstantRowGivesTheShift) {
  Rng rng(42);
  Tensor x = Tensor::empty({1, 2, 6}), shift = random_tensor({1, 6}, rng), scale = random_tensor({1, 6}, rng);
  std::fill_n(x.data<float>(), x.numel(), 3.25f);
  Tensor y = Tensor::empty({1, 2, 6}), mean = Tensor::empty({1, 2}), rstd = Tensor::empty({1, 2});
  modulated_layer_norm_forward(y, mean, rstd, x, shift, scale, kEps);
  for (int64_t i = 0; i < y.numel(); ++i) EXPECT_EQ(y.data<float>()[i], shift.data<float>()[i % 6]) << i;
  EXPECT_EQ(mean.data<float>()[0], 3.25f);
  EXPECT_FLOAT_EQ(rstd.data<float>()[1], 1.0f / std::sqrt(kEps));
}

// dx is ACCUMULATED onto what it held, dshift and dscale OVERWRITTEN (they start as NaN).
TEST(OpsModulatedLayerNorm, BackwardMatchesFiniteDifferences) {
  Rng rng(43);
  for (const Dims& s : {Dims{1, 1, 5}, Dims{2, 3, 7}, Dims{3, 2, 16}}) {
    Inputs in(s, rng, 2.0f);
    const Shape full{s.batch, s.tokens, s.dim}, rows{s.batch, s.tokens}, modulation{s.batch, s.dim};
    Tensor w = random_tensor(full, rng);
    Tensor y = Tensor::empty(full), mean = Tensor::empty(rows), rstd = Tensor::empty(rows);
    auto loss = [&] {
      modulated_layer_norm_forward(y, mean, rstd, in.x, in.shift, in.scale, kEps);
      return testing::weighted_sum(y, w);
    };
    const std::vector<double> fd_x = testing::finite_difference(in.x, loss, 1e-3f);
    const std::vector<double> fd_shift = testing::finite_difference(in.shift, loss, 1e-3f);
    const std::vector<double> fd_scale = testing::finite_difference(in.scale, loss, 1e-3f);
    modulated_layer_norm_forward(y, mean, rstd, in.x, in.shift, in.scale, kEps);

    Tensor dx = random_tensor(full, rng), dshift = Tensor::empty(modulation), dscale = Tensor::empty(modulation);
    testing::fill_nan(dshift);
    testing::fill_nan(dscale);
    const std::vector<double> dx_before = testing::to_double(dx);
    modulated_layer_norm_backward(dx, dshift, dscale, w, in.x, in.scale, mean, rstd);
    std::vector<double> dx_added = testing::to_double(dx);
    for (size_t i = 0; i < dx_added.size(); ++i) dx_added[i] -= dx_before[i];
    const std::string at = std::to_string(s.batch) + "x" + std::to_string(s.tokens) + "x" + std::to_string(s.dim);
    EXPECT_LT(relative_error(dx_added, fd_x), 1e-2) << at;
    EXPECT_LT(relative_error(dshift, fd_shift), 1e-2) << at;
    EXPECT_LT(relative_error(dscale, fd_scale), 1e-2) << at;
  }
}

TEST(OpsModulatedLayerNorm, BackwardIsDeterministic) {
  Rng rng(44);
  const Dims s{3, 70, 96};
  Inputs in(s, rng, 0.0f);
  Tensor dy = random_tensor({s.batch, s.tokens, s.dim}, rng);
  Tensor y = Tensor::empty({s.batch, s.tokens, s.dim});
  Tensor mean = Tensor::empty({s.batch, s.tokens}), rstd = Tensor::empty({s.batch, s.tokens});
  modulated_layer_norm_forward(y, mean, rstd, in.x, in.shift, in.scale, kEps);
  Tensor dx[2], dshift[2], dscale[2];
  for (int i = 0; i < 2; ++i) {
    dx[i] = Tensor::zeros({s.batch, s.tokens, s.dim});
    dshift[i] = Tensor::empty({s.batch, s.dim});
    dscale[i] = Tensor::empty({s.batch, s.dim});
    modulated_layer_norm_backward(dx[i], dshift[i], dscale[i], dy, in.x, in.scale, mean, rstd);
  }
  EXPECT_TRUE(testing::bitwise_equal(dx[0], dx[1]));
  EXPECT_TRUE(testing::bitwise_equal(dshift[0], dshift[1]));
  EXPECT_TRUE(testing::bitwise_equal(dscale[0], dscale[1]));
}

TEST(OpsModulatedLayerNorm, RejectsBadShapesAndDtypes) {
  Tensor x = Tensor::zeros({2, 3, 4}), y = Tensor::zeros({2, 3, 4});
  Tensor mean = Tensor::zeros({2, 3}), rstd = Tensor::zeros({2, 3});
  Tensor shift = Tensor::zeros({2, 4}), scale = Tensor::zeros({2, 4});
  expect_error([&] { modulated_layer_norm_forward(y, mean, rstd, Tensor::zeros({6, 4}), shift, scale, kEps); },
               {"modulated_layer_norm_forward", "[B, T, D]"});
  expect_error([&] { modulated_layer_norm_forward(y, mean, rstd, x, Tensor::zeros({1, 4}), scale, kEps); },
               {"modulated_layer_norm_forward shift"});
  expect_error([&] { modulated_layer_norm_forward(y, mean, Tensor::zeros({2, 4}), x, shift, scale, kEps); },
               {"modulated_layer_norm_forward rstd"});
  expect_error(
      [&] { modulated_layer_norm_forward(Tensor::zeros({2, 3, 4}, DType::BF16), mean, rstd, x, shift, scale, kEps); },
      {"modulated_layer_norm_forward y", "bf16"});
  Tensor dx = Tensor::zeros({2, 3, 4}), dy = Tensor::zeros({2, 3, 4});
  expect_error([&] { modulated_layer_norm_backward(dx, shift, Tensor::zeros({2, 3}), dy, x, scale, mean, rstd); },
               {"modulated_layer_norm_backward dscale"});
  expect_error(
      [&] { modulated_layer_norm_backward(dx, shift, scale, Tensor::zeros({2, 3, 5}), x, scale, mean, rstd); },
      {"modulated_layer_norm_backward dy"});
  expect_error([&] { modulated_layer_norm_backward(dx, shift, scale, dy, x, scale, Tensor::zeros({3, 2}), rstd); },
               {"modulated_layer_norm_backward mean"});
}

}  // namespace
}  // namespace forge
