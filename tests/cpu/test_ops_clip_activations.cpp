// The forward-only members of the GELU family that CLIP's text encoder uses (ops/gelu.h):
// the exact GELU and the quick GELU, against their formulas in double, with tails that stay
// finite, in place, and refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <numbers>
#include <string>

#include "expect_error.h"
#include "ops/gelu.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

using Forward = std::function<void(const Tensor&, const Tensor&)>;

double gelu_erf(double x) { return 0.5 * x * (1.0 + std::erf(x / std::numbers::sqrt2)); }
double quick_gelu(double x) { return x / (1.0 + std::exp(-1.702 * x)); }

void expect_matches(const Forward& forward, double (*formula)(double)) {
  Rng rng(71);
  Tensor in = random_tensor({3, 5, 7}, rng, 3.0), out = Tensor::empty({105});
  forward(out, in);
  std::vector<double> want(105);
  for (int64_t i = 0; i < 105; ++i) want[i] = formula(in.data<float>()[i]);
  EXPECT_LT(relative_error(out, want), 1e-6);
  // In place: the same values.
  Tensor same = in.clone();
  forward(same, same);
  EXPECT_TRUE(testing::bitwise_equal(same, out.view(same.shape())));
}

// Far in the tails the activations are x and 0, never NaN or infinite.
void expect_tails(const Forward& forward) {
  const float values[] = {-1e30f, -200.0f, -90.0f, 90.0f, 200.0f, 1e30f};
  Tensor in = Tensor::empty({6}), out = Tensor::empty({6});
  std::copy(values, values + 6, in.data<float>());
  forward(out, in);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.data<float>()[i], values[i] > 0 ? values[i] : 0.0f) << values[i];
}

void expect_refusals(const Forward& forward, const std::string& op) {
  Tensor a = Tensor::zeros({2, 4});
  expect_error([&] { forward(Tensor::zeros({9}), a); }, {op});
  expect_error([&] { forward(Tensor::zeros({8}, DType::BF16), a); }, {op + " out", "bf16"});
}

TEST(OpsGeluErf, ForwardMatchesTheErfFormula) { expect_matches(gelu_erf_forward, gelu_erf); }
TEST(OpsGeluErf, TailsStayFinite) { expect_tails(gelu_erf_forward); }
TEST(OpsGeluErf, RejectsMismatchedTensors) { expect_refusals(gelu_erf_forward, "gelu_erf_forward"); }

TEST(OpsQuickGelu, ForwardMatchesXSigmoid1702X) { expect_matches(quick_gelu_forward, quick_gelu); }
TEST(OpsQuickGelu, TailsStayFinite) { expect_tails(quick_gelu_forward); }
TEST(OpsQuickGelu, RejectsMismatchedTensors) { expect_refusals(quick_gelu_forward, "quick_gelu_forward"); }

}  // namespace
}  // namespace forge
