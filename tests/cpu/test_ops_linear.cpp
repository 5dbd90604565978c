// The linear op family (ops/linear.h) against the GEMMs it stands for: the descriptor path
// must compute bitwise what the direct matmul calls compute, and its gradients must be the
// ones finite differences see.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "expect_error.h"
#include "ops/bias.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::random_tensor;

struct LinearCase {
  int64_t tokens, in, out;
};

class OpsLinearShapes : public ::testing::TestWithParam<LinearCase> {};

TEST_P(OpsLinearShapes, DescriptorPathEqualsDirectGemmsBitwise) {
  const LinearCase c = GetParam();
  Rng rng(c.tokens * 1000 + c.in * 10 + c.out);
  const Tensor x = random_tensor({c.tokens, c.in}, rng), w = random_tensor({c.out, c.in}, rng);
  const Tensor dy = random_tensor({c.tokens, c.out}, rng), residual = random_tensor({c.tokens, c.out}, rng);
  const LinearWeight weight{w};

  Tensor y = Tensor::empty({c.tokens, c.out}), y_direct = Tensor::empty({c.tokens, c.out});
  testing::fill_nan(y);
  linear_forward(y, x, weight);
  matmul(y_direct, x, false, w, true);
  EXPECT_TRUE(bitwise_equal(y, y_direct)) << "forward";

  linear_forward(y, x, weight, &residual);
  matmul_add(y_direct, x, false, w, true, residual);
  EXPECT_TRUE(bitwise_equal(y, y_direct)) << "forward with a residual";

  Tensor in_place = residual.clone(), in_place_direct = residual.clone();
  linear_forward(in_place, x, weight, &in_place);
  matmul_add(in_place_direct, x, false, w, true, in_place_direct);
  EXPECT_TRUE(bitwise_equal(in_place, in_place_direct)) << "forward adding into the residual itself";

  Tensor dx = Tensor::empty({c.tokens, c.in}), dx_direct = Tensor::empty({c.tokens, c.in});
  testing::fill_nan(dx);
  linear_backward_input(dx, dy, weight);
  matmul(dx_direct, dy, false, w, false);
  EXPECT_TRUE(bitwise_equal(dx, dx_direct)) << "input gradient";

  // Written over a buffer of NaN (a fresh gradient buffer), then added to.
  Tensor dw = Tensor::empty({c.out, c.in}), dw_direct = Tensor::empty({c.out, c.in});
  testing::fill_nan(dw);
  linear_backward_weight(LinearWeight{dw}, dy, x, /*overwrite=*/true);
  matmul(dw_direct, dy, true, x, false, 1.0f, 0.0f);
  EXPECT_TRUE(bitwise_equal(dw, dw_direct)) << "weight gradient written over";
  linear_backward_weight(LinearWeight{dw}, dy, x, /*overwrite=*/false);
  matmul(dw_direct, dy, true, x, false, 1.0f, 1.0f);
  EXPECT_TRUE(bitwise_equal(dw, dw_direct)) << "weight gradient added";
}

INSTANTIATE_TEST_SUITE_P(OpsLinear, OpsLinearShapes,
                         ::testing::Values(LinearCase{1, 8, 8}, LinearCase{7, 9, 5}, LinearCase{33, 24, 40},
                                           LinearCase{64, 40, 24}));

// y = x W^T: the input and weight gradients of L = sum(y * R) are what finite differences
// see; a residual passes its gradient through unchanged (dL/dresidual = R).
TEST(OpsLinear, GradientsMatchFiniteDifferences) {
  Rng rng(14);
  const int64_t tokens = 7, in = 9, out = 5;
  Tensor x = random_tensor({tokens, in}, rng), w = random_tensor({out, in}, rng);
  Tensor residual = random_tensor({tokens, out}, rng), r = random_tensor({tokens, out}, rng);
  Tensor y = Tensor::empty({tokens, out});
  auto loss = [&] {
    linear_forward(y, x, LinearWeight{w}, &residual);
    return testing::weighted_sum(y, r);
  };
  Tensor dx = Tensor::empty({tokens, in}), dw = Tensor::empty({out, in});
  linear_backward_input(dx, r, LinearWeight{w});
  linear_backward_weight(LinearWeight{dw}, r, x, /*overwrite=*/true);
  EXPECT_LT(testing::relative_error(dx, testing::finite_difference(x, loss)), 1e-2);
  EXPECT_LT(testing::relative_error(dw, testing::finite_difference(w, loss)), 1e-2);
  EXPECT_LT(testing::relative_error(r, testing::finite_difference(residual, loss)), 1e-2);
}

// NOTE [Linear bias]: y = x W^T (+ residual) + b on every row, and the bias's gradient is
// the column sums of dy, written over the gradient buffer or added to it.
TEST(OpsLinear, BiasIsAddedToEveryRowAndItsGradientIsTheColumnSum) {
  Rng rng(15);
  const int64_t tokens = 9, in = 6, out = 5;
  const Tensor x = random_tensor({tokens, in}, rng), w = random_tensor({out, in}, rng), b = random_tensor({out}, rng);
  const Tensor dy = random_tensor({tokens, out}, rng), residual = random_tensor({tokens, out}, rng);
  const LinearWeight weight{.weight = w, .bias = b};

  Tensor y = Tensor::empty({tokens, out}), want = Tensor::empty({tokens, out});
  testing::fill_nan(y);
  linear_forward(y, x, weight);
  matmul(want, x, false, w, true);
  for (int64_t n = 0; n < tokens; ++n)
    for (int64_t f = 0; f < out; ++f) want.data<float>()[n * out + f] += b.data<float>()[f];
  EXPECT_TRUE(bitwise_equal(y, want)) << "forward";
  linear_forward(y, x, weight, &residual);
  matmul_add(want, x, false, w, true, residual);
  for (int64_t n = 0; n < tokens; ++n)
    for (int64_t f = 0; f < out; ++f) want.data<float>()[n * out + f] += b.data<float>()[f];
  EXPECT_TRUE(bitwise_equal(y, want)) << "forward with a residual";

  std::vector<double> sums(out, 0.0);
  for (int64_t n = 0; n < tokens; ++n)
    for (int64_t f = 0; f < out; ++f) sums[f] += dy.data<float>()[n * out + f];
  Tensor dw = Tensor::empty({out, in}), db = Tensor::empty({out});
  const LinearWeight grad{.weight = dw, .bias = db};
  testing::fill_nan(db);
  linear_backward_weight(grad, dy, x, /*overwrite=*/true);
  EXPECT_LT(testing::relative_error(db, sums), 1e-6) << "written over";
  linear_backward_weight(grad, dy, x, /*overwrite=*/false);
  std::vector<double> twice = sums;
  for (double& v : twice) v *= 2.0;
  EXPECT_LT(testing::relative_error(db, twice), 1e-6) << "added";

  // Both backward ops at once, and a frozen weight (no weight gradient) whose bias trains.
  Tensor dx = Tensor::empty({tokens, in});
  testing::fill_nan(db);
  linear_backward(dx, grad, dy, x, weight, /*overwrite=*/true);
  EXPECT_LT(testing::relative_error(db, sums), 1e-6) << "linear_backward";
  LinearWeight frozen;
  frozen.bias = db;
  linear_backward(dx, frozen, dy, x, weight, /*overwrite=*/false);
  EXPECT_LT(testing::relative_error(db, twice), 1e-6) << "frozen weight";
}

TEST(OpsLinear, BiasGradientMatchesFiniteDifferences) {
  Rng rng(16);
  const int64_t tokens = 6, in = 4, out = 3;
  Tensor x = random_tensor({tokens, in}, rng), w = random_tensor({out, in}, rng), b = random_tensor({out}, rng);
  Tensor r = random_tensor({tokens, out}, rng), y = Tensor::empty({tokens, out});
  auto loss = [&] {
    linear_forward(y, x, LinearWeight{.weight = w, .bias = b});
    return testing::weighted_sum(y, r);
  };
  Tensor dx = Tensor::empty({tokens, in}), dw = Tensor::empty({out, in}), db = Tensor::empty({out});
  linear_backward(dx, LinearWeight{.weight = dw, .bias = db}, r, x, LinearWeight{.weight = w, .bias = b},
                  /*overwrite=*/true);
  EXPECT_LT(testing::relative_error(db, testing::finite_difference(b, loss)), 1e-3);
  EXPECT_LT(testing::relative_error(dw, testing::finite_difference(w, loss)), 1e-2);
  EXPECT_LT(testing::relative_error(dx, testing::finite_difference(x, loss)), 1e-2);
}

TEST(OpsLinear, BiasOfTheWrongShapeIsAClearError) {
  const Tensor x = Tensor::zeros({2, 3}), w = Tensor::zeros({4, 3}), y = Tensor::zeros({2, 4});
  expect_error([&] { linear_forward(y, x, LinearWeight{.weight = w, .bias = Tensor::zeros({5})}); },
               {"add_bias bias", "[5]"});
  const LinearWeight grad{.weight = Tensor::zeros({4, 3}), .bias = Tensor::zeros({3})};
  expect_error([&] { linear_backward_weight(grad, y, x, true); }, {"bias_gradient grad_bias"});
  expect_error([&] { bias_gradient(Tensor::zeros({4}), Tensor::zeros({2, 2, 4}), true); }, {"bias_gradient: dy"});
}

}  // namespace
}  // namespace forge
