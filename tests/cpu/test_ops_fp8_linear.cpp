// The FP8 tensorwise linear ops on the CPU (NOTE [FP8 tensorwise linear] in
// ops/fp8_linear.h), reached through the linear op family with an FP8 descriptor, against
// a straightforward reference built from kernels/cpu/fp8_scaling: each operand's amax,
// torchao's scale, the saturating quantization, dequantization to fp32, and a matmul of
// the dequantized values in double. The op multiplies the decoded codes, sums in fp32 and
// applies the fp32 inverse scales once per output; the reference divides every element by
// its scale first and sums in double: the two agree to fp32 rounding (1e-5 of the
// result's largest magnitude).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/fp8_scaling.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "fp8_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

using cpu::Fp8Format;
using testing::random_tensor;
using testing::fake_quantized;
using testing::reference_gemm;
using testing::relative_error;

constexpr double kTolerance = 1e-5;

struct Fp8Case {
  int64_t tokens, in, out;
  Fp8Format grad_format;
};

class OpsFp8Linear : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(OpsFp8Linear, GemmsAreTheQuantizedOperandsProducts) {
  const Fp8Case c = GetParam();
  Rng rng(c.tokens * 1000 + c.in * 10 + c.out);
  const Tensor x = random_tensor({c.tokens, c.in}, rng), w = random_tensor({c.out, c.in}, rng, 0.02);
  const Tensor dy = random_tensor({c.tokens, c.out}, rng, 1e-3), residual = random_tensor({c.tokens, c.out}, rng);
  const Fp8Linear fp8{c.grad_format, nullptr};
  const LinearWeight weight{w, nullptr, nullptr, &fp8};
  const std::vector<double> xq = fake_quantized(x, Fp8Format::E4M3), wq = fake_quantized(w, Fp8Format::E4M3);
  const std::vector<double> dyq = fake_quantized(dy, c.grad_format);

  // y = x W^T, then y = residual + x W^T (into a separate buffer, then into the residual itself).
  const std::vector<double> y_want = reference_gemm(xq, c.in, 1, wq, c.in, 1, c.tokens, c.out, c.in);
  Tensor y = Tensor::empty({c.tokens, c.out});
  testing::fill_nan(y);
  linear_forward(y, x, weight);
  EXPECT_LT(relative_error(y, y_want), kTolerance) << "forward";
  // The quantization is real: the result is off the fp32 GEMM by E4M3's rounding (3
  // mantissa bits: up to 1/16 per element, a few percent of a dot product), not by zero.
  Tensor y_fp32 = Tensor::empty({c.tokens, c.out});
  matmul(y_fp32, x, false, w, true);
  const double off = relative_error(y, testing::to_double(y_fp32));
  if (c.in > 1) EXPECT_GT(off, 1e-3);  // one element per operand: x and W land on 448 exactly
  EXPECT_LT(off, 0.1);
  std::vector<double> y_res_want = y_want;
  for (size_t i = 0; i < y_res_want.size(); ++i) y_res_want[i] += residual.data<float>()[i];
  testing::fill_nan(y);
  linear_forward(y, x, weight, &residual);
  EXPECT_LT(relative_error(y, y_res_want), kTolerance) << "forward with a residual";
  Tensor in_place = residual.clone();
  linear_forward(in_place, x, weight, &in_place);
  EXPECT_LT(relative_error(in_place, y_res_want), kTolerance) << "forward adding into the residual itself";

  // dx = dy W.
  const std::vector<double> dx_want = reference_gemm(dyq, c.out, 1, wq, 1, c.in, c.tokens, c.in, c.out);
  Tensor dx = Tensor::empty({c.tokens, c.in});
  testing::fill_nan(dx);
  linear_backward_input(dx, dy, weight);
  EXPECT_LT(relative_error(dx, dx_want), kTolerance) << "input gradient";

  // dW = dy^T x, written over a NaN buffer, then added to.
  const std::vector<double> dw_want = reference_gemm(dyq, 1, c.out, xq, 1, c.in, c.out, c.in, c.tokens);
  Tensor dw = Tensor::empty({c.out, c.in});
  testing::fill_nan(dw);
  const LinearWeight grad{dw, nullptr, nullptr, &fp8};
  linear_backward_weight(grad, dy, x, /*overwrite=*/true);
  EXPECT_LT(relative_error(dw, dw_want), kTolerance) << "weight gradient written over";
  std::vector<double> twice = dw_want;
  for (double& v : twice) v *= 2.0;
  linear_backward_weight(grad, dy, x, /*overwrite=*/false);
  EXPECT_LT(relative_error(dw, twice), kTolerance) << "weight gradient added";
}

INSTANTIATE_TEST_SUITE_P(Shapes, OpsFp8Linear,
                         ::testing::Values(Fp8Case{1, 1, 1, Fp8Format::E5M2}, Fp8Case{7, 24, 40, Fp8Format::E5M2},
                                           Fp8Case{33, 40, 24, Fp8Format::E4M3},
                                           Fp8Case{64, 48, 96, Fp8Format::E5M2}));

// E5M2 and E4M3 gradients give different input and weight gradients (the format reaches
// the GEMMs), and the forward does not depend on it.
TEST(OpsFp8LinearFormats, TheGradFormatReachesBothBackwardGemms) {
  Rng rng(7);
  const Tensor x = random_tensor({16, 32}, rng), w = random_tensor({24, 32}, rng), dy = random_tensor({16, 24}, rng);
  const Fp8Linear e5m2{Fp8Format::E5M2, nullptr}, e4m3{Fp8Format::E4M3, nullptr};
  Tensor dx5 = Tensor::empty({16, 32}), dx4 = Tensor::empty({16, 32}), dw5 = Tensor::empty({24, 32}),
         dw4 = Tensor::empty({24, 32}), y5 = Tensor::empty({16, 24}), y4 = Tensor::empty({16, 24});
  linear_forward(y5, x, LinearWeight{w, nullptr, nullptr, &e5m2});
  linear_forward(y4, x, LinearWeight{w, nullptr, nullptr, &e4m3});
  EXPECT_TRUE(testing::bitwise_equal(y5, y4));
  linear_backward_input(dx5, dy, LinearWeight{w, nullptr, nullptr, &e5m2});
  linear_backward_input(dx4, dy, LinearWeight{w, nullptr, nullptr, &e4m3});
  EXPECT_FALSE(testing::bitwise_equal(dx5, dx4));
  linear_backward_weight(LinearWeight{dw5, nullptr, nullptr, &e5m2}, dy, x, true);
  linear_backward_weight(LinearWeight{dw4, nullptr, nullptr, &e4m3}, dy, x, true);
  EXPECT_FALSE(testing::bitwise_equal(dw5, dw4));
}

// Inputs far past E4M3's range are scaled into it and the result stays finite; a NaN input
// reaches the output as NaN (as torchao: nothing refuses it, the trainer's non-finite
// handling sees it in the loss or the gradients).
TEST(OpsFp8LinearFormats, HugeInputsStayFiniteAndNaNPropagates) {
  Rng rng(9);
  Tensor x = random_tensor({4, 16}, rng, 1e6);
  const Tensor w = random_tensor({8, 16}, rng);
  const Fp8Linear fp8{Fp8Format::E5M2, nullptr};
  Tensor y = Tensor::empty({4, 8});
  linear_forward(y, x, LinearWeight{w, nullptr, nullptr, &fp8});
  for (int64_t i = 0; i < y.numel(); ++i) ASSERT_TRUE(std::isfinite(y.data<float>()[i])) << i;
  x.data<float>()[5] = std::nanf("");
  linear_forward(y, x, LinearWeight{w, nullptr, nullptr, &fp8});
  EXPECT_TRUE(std::isnan(y.data<float>()[0]));
}

}  // namespace
}  // namespace forge
