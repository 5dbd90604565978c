#include <gtest/gtest.h>

#include <cmath>

#include "ops/swiglu.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

TEST(OpsSwiglu, ForwardMatchesDoublePrecision) {
  Rng rng(31);
  const int64_t shapes[][2] = {{1, 1}, {5, 33}, {8, 64}};
  for (const auto& s : shapes) {
    int64_t rows = s[0], ffn = s[1];
    Tensor gate_up = random_tensor({rows, 2 * ffn}, rng, 3.0);
    Tensor out = Tensor::empty({rows, ffn});
    swiglu_forward(out, gate_up);
    std::vector<double> want(rows * ffn);
    const float* p = gate_up.data<float>();
    for (int64_t n = 0; n < rows; ++n) {
      for (int64_t f = 0; f < ffn; ++f) {
        double g = p[n * 2 * ffn + f], u = p[n * 2 * ffn + ffn + f];
        want[n * ffn + f] = g / (1.0 + std::exp(-g)) * u;
      }
    }
    EXPECT_LT(relative_error(out, want), 1e-5) << rows << "x" << ffn;
  }
}

TEST(OpsSwiglu, BackwardMatchesFiniteDifferences) {
  Rng rng(32);
  const int64_t shapes[][2] = {{1, 1}, {3, 7}, {4, 16}};
  for (const auto& s : shapes) {
    int64_t rows = s[0], ffn = s[1];
    Tensor gate_up = random_tensor({rows, 2 * ffn}, rng, 2.0), r = random_tensor({rows, ffn}, rng);
    Tensor out = Tensor::empty({rows, ffn});
    auto loss = [&] {
      swiglu_forward(out, gate_up);
      return testing::weighted_sum(out, r);
    };
    std::vector<double> fd = testing::finite_difference(gate_up, loss, 1e-3f);
    Tensor dgate_up = Tensor::empty({rows, 2 * ffn});
    swiglu_backward(dgate_up, r, gate_up);
    EXPECT_LT(relative_error(dgate_up, fd), 1e-2) << rows << "x" << ffn;
  }
}

TEST(OpsSwiglu, ExtremeGatesStayFinite) {
  Tensor gate_up = Tensor::empty({1, 8});
  const float values[] = {-200.0f, -90.0f, 90.0f, 200.0f, 1.0f, 1.0f, 1.0f, 1.0f};
  std::copy(values, values + 8, gate_up.data<float>());
  Tensor out = Tensor::empty({1, 4}), dgate_up = Tensor::empty({1, 8}), dout = Tensor::empty({1, 4});
  std::fill_n(dout.data<float>(), 4, 1.0f);
  swiglu_forward(out, gate_up);
  swiglu_backward(dgate_up, dout, gate_up);
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(std::isfinite(out.data<float>()[i])) << i;
  for (int i = 0; i < 8; ++i) EXPECT_TRUE(std::isfinite(dgate_up.data<float>()[i])) << i;
  EXPECT_EQ(out.data<float>()[0], 0.0f);
  EXPECT_EQ(out.data<float>()[3], 200.0f);
}

TEST(OpsSwiglu, IsDeterministic) {
  Rng rng(33);
  Tensor gate_up = random_tensor({64, 192}, rng), dout = random_tensor({64, 96}, rng);
  Tensor a = Tensor::empty({64, 192}), b = Tensor::empty({64, 192});
  swiglu_backward(a, dout, gate_up);
  swiglu_backward(b, dout, gate_up);
  EXPECT_TRUE(testing::bitwise_equal(a, b));
}

TEST(OpsSwiglu, RejectsOddWidth) {
  Tensor gate_up = Tensor::zeros({2, 5}), out = Tensor::zeros({2, 2});
  EXPECT_THROW(swiglu_forward(out, gate_up), Error);
}

}  // namespace
}  // namespace forge
