// The elementwise ops of the FLUX blocks: GELU (tanh), SiLU and the gated residual add.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numbers>
#include <string>
#include <tuple>

#include "expect_error.h"
#include "ops/gated_residual.h"
#include "ops/gelu.h"
#include "ops/silu.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

using UnaryForward = std::function<void(const Tensor&, const Tensor&)>;
using UnaryBackward = std::function<void(const Tensor&, const Tensor&, const Tensor&)>;

double gelu_tanh(double x) {
  return 0.5 * x * (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}
double silu(double x) { return x / (1.0 + std::exp(-x)); }

// out against the formula in double, on a [3, 5, 7] input written into a flat [105] output
// (any shapes with the same element count), inputs spread wide enough to reach both tails.
void expect_forward_matches(const UnaryForward& forward, double (*formula)(double)) {
  Rng rng(51);
  Tensor in = random_tensor({3, 5, 7}, rng, 3.0), out = Tensor::empty({105});
  forward(out, in);
  std::vector<double> want(105);
  for (int64_t i = 0; i < 105; ++i) want[i] = formula(in.data<float>()[i]);
  EXPECT_LT(relative_error(out, want), 1e-6);
}

// din against central differences of sum(out * dout); din starts as NaN (overwritten).
void expect_backward_matches(const UnaryForward& forward, const UnaryBackward& backward) {
  Rng rng(52);
  for (const Shape& shape : {Shape{1}, Shape{2, 3, 7}, Shape{4, 33}}) {
    Tensor in = random_tensor(shape, rng, 2.0), dout = random_tensor(shape, rng), out = Tensor::empty(shape);
    auto loss = [&] {
      forward(out, in);
      return testing::weighted_sum(out, dout);
    };
    const std::vector<double> fd = testing::finite_difference(in, loss, 1e-3f);
    Tensor din = Tensor::empty(shape);
    testing::fill_nan(din);
    backward(din, dout, in);
    EXPECT_LT(relative_error(din, fd), 1e-2) << shape_str(shape);
  }
}

// Far in the tails both activations are x or 0 and their derivatives 1 or 0, never NaN.
void expect_tails(const UnaryForward& forward, const UnaryBackward& backward) {
  Tensor in = Tensor::empty({4}), out = Tensor::empty({4}), din = Tensor::empty({4}), dout = Tensor::empty({4});
  const float values[] = {-200.0f, -90.0f, 90.0f, 200.0f};
  std::copy(values, values + 4, in.data<float>());
  std::fill_n(dout.data<float>(), 4, 1.0f);
  forward(out, in);
  backward(din, dout, in);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(out.data<float>()[i], values[i] > 0 ? values[i] : 0.0f) << values[i];
    EXPECT_EQ(din.data<float>()[i], values[i] > 0 ? 1.0f : 0.0f) << values[i];
  }
}

void expect_rejects_mismatch(const UnaryForward& forward, const UnaryBackward& backward, const std::string& op) {
  Tensor a = Tensor::zeros({2, 4}), b = Tensor::zeros({9});
  expect_error([&] { forward(b, a); }, {op + "_forward"});
  expect_error([&] { backward(a, b, a); }, {op + "_backward"});
  expect_error([&] { forward(Tensor::zeros({8}, DType::BF16), a); }, {op + "_forward out", "bf16"});
}

TEST(OpsGelu, ForwardMatchesTheTanhFormula) { expect_forward_matches(gelu_tanh_forward, gelu_tanh); }
TEST(OpsGelu, BackwardMatchesFiniteDifferences) { expect_backward_matches(gelu_tanh_forward, gelu_tanh_backward); }
TEST(OpsGelu, TailsStayFinite) { expect_tails(gelu_tanh_forward, gelu_tanh_backward); }
TEST(OpsGelu, RejectsMismatchedSizes) { expect_rejects_mismatch(gelu_tanh_forward, gelu_tanh_backward, "gelu_tanh"); }

TEST(OpsSilu, ForwardMatchesTheFormula) { expect_forward_matches(silu_forward, silu); }
TEST(OpsSilu, BackwardMatchesFiniteDifferences) { expect_backward_matches(silu_forward, silu_backward); }
TEST(OpsSilu, TailsStayFinite) { expect_tails(silu_forward, silu_backward); }
TEST(OpsSilu, RejectsMismatchedSizes) { expect_rejects_mismatch(silu_forward, silu_backward, "silu"); }

TEST(OpsGatedResidual, ForwardAddsTheGatedBranchInPlace) {
  Rng rng(53);
  const int64_t batch = 2, tokens = 3, dim = 7;
  Tensor x = random_tensor({batch, tokens, dim}, rng), y = random_tensor({batch, tokens, dim}, rng);
  Tensor gate = random_tensor({batch, dim}, rng);
  std::vector<double> want(x.numel());
  for (int64_t i = 0; i < x.numel(); ++i)
    want[i] = static_cast<double>(x.data<float>()[i]) +
              static_cast<double>(gate.data<float>()[i / (tokens * dim) * dim + i % dim]) * y.data<float>()[i];
  gated_residual_forward(x, y, gate);
  EXPECT_LT(relative_error(x, want), 1e-6);
}

// out = x + gate * y beside x, which stays as it was: the same values as the add in place.
TEST(OpsGatedResidual, ForwardIntoASeparateOutputKeepsTheInput) {
  Rng rng(56);
  const int64_t batch = 2, tokens = 5, dim = 16;
  Tensor x = random_tensor({batch, tokens, dim}, rng), y = random_tensor({batch, tokens, dim}, rng);
  Tensor gate = random_tensor({batch, dim}, rng);
  const Tensor x_before = x.clone();
  Tensor out = Tensor::empty({batch, tokens, dim});
  testing::fill_nan(out);
  gated_residual_forward(out, x, y, gate);
  Tensor in_place = x.clone();
  gated_residual_forward(in_place, y, gate);
  EXPECT_TRUE(testing::bitwise_equal(out, in_place));
  EXPECT_TRUE(testing::bitwise_equal(x, x_before));
  expect_error([&] { gated_residual_forward(Tensor::zeros({2, 5, 8}), x, y, gate); },
               {"gated_residual_forward out"});
  expect_error([&] { gated_residual_forward(y, x, y, gate); }, {"gated_residual_forward", "alias"});
}

// Loss sum(w * x_after): the residual stream's gradient dx is w; dy and dgate start as NaN
// (overwritten) and must match central differences in y and gate.
TEST(OpsGatedResidual, BackwardMatchesFiniteDifferences) {
  Rng rng(54);
  for (auto [batch, tokens, dim] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {2, 3, 7}, {3, 5, 16}}) {
    const Shape full{batch, tokens, dim};
    Tensor x = random_tensor(full, rng), y = random_tensor(full, rng), gate = random_tensor({batch, dim}, rng);
    Tensor w = random_tensor(full, rng);
    auto loss = [&] {
      Tensor after = x.clone();
      gated_residual_forward(after, y, gate);
      return testing::weighted_sum(after, w);
    };
    const std::vector<double> fd_y = testing::finite_difference(y, loss, 1e-3f);
    const std::vector<double> fd_gate = testing::finite_difference(gate, loss, 1e-3f);
    Tensor dy = Tensor::empty(full), dgate = Tensor::empty({batch, dim});
    testing::fill_nan(dy);
    testing::fill_nan(dgate);
    gated_residual_backward(dy, dgate, w, y, gate);
    EXPECT_LT(relative_error(dy, fd_y), 1e-2) << shape_str(full);
    EXPECT_LT(relative_error(dgate, fd_gate), 1e-2) << shape_str(full);
  }
}

TEST(OpsGatedResidual, BackwardIsDeterministic) {
  Rng rng(55);
  const Shape full{3, 70, 96};
  Tensor dx = random_tensor(full, rng), y = random_tensor(full, rng), gate = random_tensor({3, 96}, rng);
  Tensor dy[2] = {Tensor::empty(full), Tensor::empty(full)};
  Tensor dgate[2] = {Tensor::empty({3, 96}), Tensor::empty({3, 96})};
  for (int i = 0; i < 2; ++i) gated_residual_backward(dy[i], dgate[i], dx, y, gate);
  EXPECT_TRUE(testing::bitwise_equal(dy[0], dy[1]));
  EXPECT_TRUE(testing::bitwise_equal(dgate[0], dgate[1]));
}

TEST(OpsGatedResidual, RejectsBadShapes) {
  Tensor x = Tensor::zeros({2, 3, 4}), y = Tensor::zeros({2, 3, 4}), gate = Tensor::zeros({2, 4});
  expect_error([&] { gated_residual_forward(Tensor::zeros({6, 4}), Tensor::zeros({6, 4}), gate); },
               {"gated_residual_forward", "[B, T, D]"});
  expect_error([&] { gated_residual_forward(x, Tensor::zeros({2, 4, 3}), gate); }, {"gated_residual_forward y"});
  expect_error([&] { gated_residual_forward(x, y, Tensor::zeros({1, 4})); }, {"gated_residual_forward gate"});
  expect_error([&] { gated_residual_backward(y, Tensor::zeros({2, 3}), x, y, gate); },
               {"gated_residual_backward dgate"});
  expect_error([&] { gated_residual_backward(Tensor::zeros({2, 3, 4}, DType::BF16), gate, x, y, gate); },
               {"gated_residual_backward dy", "bf16"});
}

}  // namespace
}  // namespace forge
