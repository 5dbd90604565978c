// NF4 storage (ops/nf4.h): the layout of codes and statistics, round trips within NF4's
// resolution, the errors for bad weights and mismatched buffers, and the linear op on an
// NF4 descriptor, which must compute bitwise what it computes on the dequantized weight.
// Bitwise agreement with bitsandbytes is tests/python/test_nf4_vs_bitsandbytes.py.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "core/bf16.h"
#include "core/rng.h"
#include "expect_error.h"
#include "kernels/cpu/nf4.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "ops/nf4.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::random_tensor;

Tensor dequantized(const Nf4Tensor& q) {
  Tensor out = Tensor::empty(q.shape);
  nf4_dequantize(out, q);
  return out;
}

TEST(OpsNf4, LayoutOfCodesAndStatistics) {
  Rng rng(1);
  for (const Shape& shape : std::vector<Shape>{{1, 1}, {7, 9}, {5, 13}, {64, 64}, {100, 300}}) {
    const int64_t n = shape_numel(shape), blocks = (n + 63) / 64;
    const Nf4Tensor q = nf4_quantize(random_tensor(shape, rng));
    EXPECT_EQ(q.shape, shape);
    EXPECT_EQ(q.codes.shape(), Shape{(n + 1) / 2});
    EXPECT_EQ(q.absmax_codes.shape(), Shape{blocks});
    EXPECT_EQ(q.absmax_scales.shape(), Shape{(blocks + 255) / 256});
    EXPECT_EQ(q.nbytes(), static_cast<size_t>((n + 1) / 2 + blocks + 4 * ((blocks + 255) / 256) + 4));
    if (n % 2) EXPECT_EQ(q.codes.data<uint8_t>()[n / 2] & 0x0f, 7) << "odd count pads with the code of 0.0";
  }
}

TEST(OpsNf4, TheLevelsThemselvesComeBackExactly) {
  // One block holding every NF4 level (absmax 1): codes are the levels' indices, element
  // 2i in the high nibble, and the single absmax survives double quantization exactly
  // (the offset is the absmax itself, the centered value 0).
  Tensor w = Tensor::empty({2, 32});
  for (int i = 0; i < 64; ++i) w.data<float>()[i] = cpu::kNf4Code[(i * 5) % 16];
  const Nf4Tensor q = nf4_quantize(w);
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(q.codes.data<uint8_t>()[i], ((2 * i * 5) % 16) << 4 | ((2 * i + 1) * 5) % 16) << "byte " << i;
  EXPECT_EQ(q.absmax_offset, 1.0f);
  EXPECT_TRUE(bitwise_equal(dequantized(q), w));
}

TEST(OpsNf4, RoundTripIsWithinHalfAStepOfTheBlockAbsmax) {
  Rng rng(2);
  float half_step = 0.0f;  // the widest gap between NF4 levels is -1 .. -0.6962
  for (int i = 0; i < 15; ++i) half_step = std::max(half_step, (cpu::kNf4Code[i + 1] - cpu::kNf4Code[i]) / 2);
  for (DType dtype : {DType::F32, DType::BF16}) {
    const Tensor w = random_tensor({37, 211}, rng, 0.02);  // 7807 weights: a partial last block
    Tensor input = w;
    if (dtype == DType::BF16) {
      input = Tensor::empty(w.shape(), DType::BF16);
      for (int64_t i = 0; i < w.numel(); ++i) input.data<BFloat16>()[i] = to_bf16(w.data<float>()[i]);
      for (int64_t i = 0; i < w.numel(); ++i) w.data<float>()[i] = to_float(input.data<BFloat16>()[i]);
    }
    const Nf4Tensor q = nf4_quantize(input);
    const Tensor back = dequantized(q), absmax = nf4_absmax(q);
    for (int64_t i = 0; i < w.numel(); ++i) {
      float block_max = 0.0f;
      for (int64_t j = i / 64 * 64; j < std::min<int64_t>(w.numel(), i / 64 * 64 + 64); ++j)
        block_max = std::max(block_max, std::fabs(w.data<float>()[j]));
      // Half a step at the block's scale, plus the double-quantized absmax's own error.
      const float tolerance = half_step * block_max + std::fabs(absmax.data<float>()[i / 64] - block_max);
      ASSERT_LE(std::fabs(back.data<float>()[i] - w.data<float>()[i]), tolerance * 1.0001f) << "element " << i;
    }
  }
}

TEST(OpsNf4, Bf16DequantizationRoundsTheFp32Values) {
  Rng rng(3);
  const Nf4Tensor q = nf4_quantize(random_tensor({9, 64}, rng));
  const Tensor f32 = dequantized(q);
  Tensor bf16 = Tensor::empty(q.shape, DType::BF16);
  nf4_dequantize(bf16, q);
  for (int64_t i = 0; i < f32.numel(); ++i)
    ASSERT_EQ(bf16.data<BFloat16>()[i].bits, to_bf16(f32.data<float>()[i]).bits) << "element " << i;
}

TEST(OpsNf4, ZeroAndConstantWeights) {
  const Nf4Tensor zero = nf4_quantize(Tensor::zeros({4, 100}));
  for (int64_t i = 0; i < zero.codes.numel(); ++i) ASSERT_EQ(zero.codes.data<uint8_t>()[i], 0x77);
  EXPECT_TRUE(bitwise_equal(dequantized(zero), Tensor::zeros({4, 100})));

  Tensor constant = Tensor::empty({3, 128});
  std::fill_n(constant.data<float>(), constant.numel(), -0.375f);
  EXPECT_TRUE(bitwise_equal(dequantized(nf4_quantize(constant)), constant));
}

TEST(OpsNf4, TorchOrderSumAddsExactlyRepresentableValues) {
  // Every partial sum here is an integer below 2^24, so any order gives the exact total;
  // the order itself is checked against PyTorch in the Python test.
  for (int64_t n : {0, 1, 5, 16, 17, 63, 64, 1000, 4097, 70000}) {
    std::vector<float> ones(n, 1.0f), counting(n);
    std::iota(counting.begin(), counting.end(), 1.0f);
    EXPECT_EQ(cpu::torch_order_sum(ones.data(), n), static_cast<float>(n)) << n << " ones";
    if (n <= 4097)
      EXPECT_EQ(cpu::torch_order_sum(counting.data(), n), static_cast<float>(n * (n + 1) / 2)) << "1.." << n;
  }
}

TEST(OpsNf4, RejectsBadWeightsAndBuffers) {
  expect_error([] { nf4_quantize(Tensor::empty({0, 8})); }, {"nf4_quantize", "no elements"});
  expect_error([] { nf4_quantize(Tensor::zeros({2, 2}, DType::I32)); }, {"nf4_quantize", "i32", "f32 or bf16"});
  Tensor bad = Tensor::zeros({2, 3});
  bad.data<float>()[4] = std::numeric_limits<float>::infinity();
  expect_error([&] { nf4_quantize(bad); }, {"element 4", "[2, 3]", "inf", "finite"});
  bad.data<float>()[4] = std::numeric_limits<float>::quiet_NaN();
  expect_error([&] { nf4_quantize(bad); }, {"element 4", "nan"});

  Rng rng(4);
  const Nf4Tensor q = nf4_quantize(random_tensor({8, 64}, rng));
  expect_error([&] { nf4_dequantize(Tensor::empty({64, 8}), q); }, {"nf4_dequantize out", "[64, 8]", "[8, 64]"});
  expect_error([&] { nf4_dequantize(Tensor::empty({8, 64}, DType::I32), q); }, {"nf4_dequantize out", "i32"});
  Nf4Tensor truncated = q;
  truncated.codes = q.codes.narrow(0, 10);
  expect_error([&] { nf4_dequantize(Tensor::empty({8, 64}), truncated); }, {"nf4 codes", "[10]", "[256]"});
  Nf4Tensor wrong_stats = q;
  wrong_stats.absmax_scales = Tensor::zeros({2});
  expect_error([&] { nf4_dequantize(Tensor::empty({8, 64}), wrong_stats); }, {"nf4 absmax_scales", "[2]", "[1]"});
}

TEST(OpsNf4, StackedPartsDequantizeIntoTheirRows) {
  Rng rng(6);
  const Nf4Weight w{{nf4_quantize(random_tensor({3, 70}, rng)), nf4_quantize(random_tensor({5, 70}, rng))}};
  EXPECT_EQ(w.shape(), (Shape{8, 70}));
  EXPECT_EQ(w.nbytes(), w.parts[0].nbytes() + w.parts[1].nbytes());
  Tensor out = Tensor::empty({8, 70});
  testing::fill_nan(out);
  nf4_dequantize(out, w);
  EXPECT_TRUE(bitwise_equal(out.narrow(0, 3), dequantized(w.parts[0])));
  EXPECT_TRUE(bitwise_equal(out.narrow(3, 8), dequantized(w.parts[1])));
  const Nf4Weight mismatched{{nf4_quantize(random_tensor({3, 70}, rng)), nf4_quantize(random_tensor({5, 64}, rng))}};
  expect_error([&] { mismatched.shape(); }, {"part 1", "[5, 64]", "[rows, 70]"});
  expect_error([&] { nf4_dequantize(Tensor::empty({7, 70}), w); }, {"nf4_dequantize out", "[7, 70]", "[8, 70]"});
}

// A stacked weight (as forge's fused qkv: three Hugging Face tensors) on the linear ops.
TEST(OpsNf4, LinearOnAnNf4WeightEqualsLinearOnItsDequantizedWeight) {
  Rng rng(5);
  for (const auto& [tokens, in, out] : std::vector<std::array<int64_t, 3>>{{5, 64, 48}, {3, 100, 9}, {16, 96, 200}}) {
    const Tensor x = random_tensor({tokens, in}, rng), dy = random_tensor({tokens, out}, rng);
    const Tensor residual = random_tensor({tokens, out}, rng);
    Nf4Weight w;
    for (int64_t rows : {out / 3, out / 3, out - 2 * (out / 3)})
      w.parts.push_back(nf4_quantize(random_tensor({rows, in}, rng, 0.05)));
    Tensor plain = Tensor::empty({out, in});
    nf4_dequantize(plain, w);
    Tensor scratch = Tensor::empty({out, in});
    testing::fill_nan(scratch);
    const LinearWeight nf4_weight{.weight = scratch, .nf4 = &w}, plain_weight{plain};

    Tensor y = Tensor::empty({tokens, out}), y_plain = Tensor::empty({tokens, out});
    linear_forward(y, x, nf4_weight);
    linear_forward(y_plain, x, plain_weight);
    EXPECT_TRUE(bitwise_equal(y, y_plain)) << "forward " << out << "x" << in;
    testing::fill_nan(scratch);
    linear_forward(y, x, nf4_weight, &residual);
    linear_forward(y_plain, x, plain_weight, &residual);
    EXPECT_TRUE(bitwise_equal(y, y_plain)) << "forward with a residual";

    Tensor dx = Tensor::empty({tokens, in}), dx_plain = Tensor::empty({tokens, in});
    testing::fill_nan(scratch);
    linear_backward_input(dx, dy, nf4_weight);
    linear_backward_input(dx_plain, dy, plain_weight);
    EXPECT_TRUE(bitwise_equal(dx, dx_plain)) << "input gradient";

    const LinearWeight grad{.weight = Tensor::zeros({out, in}), .nf4 = &w};
    expect_error([&] { linear_backward_weight(grad, dy, x, true); }, {"NF4", "frozen", "no gradient"});
  }
}

}  // namespace
}  // namespace forge
