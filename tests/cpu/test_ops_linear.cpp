// The linear op family (ops/linear.h) against the GEMMs it stands for: the descriptor path
// must compute bitwise what the direct matmul calls compute, and its gradients must be the
// ones finite differences see.
#include <gtest/gtest.h>

#include "core/rng.h"
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

}  // namespace
}  // namespace forge
