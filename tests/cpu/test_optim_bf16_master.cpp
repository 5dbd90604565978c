// bf16 master weights (NOTE [bf16 master weights] in optim/optimizer.h) and the stochastic
// rounding behind them (NOTE [Stochastic rounding to bf16] in kernels/stochastic_rounding.h):
// the rounding picks one of the two neighbouring bf16 values with the odds that make it
// unbiased, leaves bf16 values, inf and NaN alone and never carries into inf; its bits are
// Philox words of (seed, step, index); AdamW on a bf16 param is the fp32 update rounded to a
// neighbour, with the fp32 run's moments, the same however the tensor is split into calls;
// and updates far below a bf16 ulp add up over steps as the fp32 masters' do, where rounding
// to nearest would lose them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "core/bf16.h"
#include "core/rng.h"
#include "kernels/stochastic_rounding.h"
#include "ops/adamw.h"

namespace forge {
namespace {

namespace sr = stochastic_rounding;

float bits_to_float(uint16_t b) { return to_float(BFloat16{b}); }

// The bf16 values at and above |x|'s truncation, with x's sign: lo rounds toward zero.
std::pair<float, float> neighbours(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  return {bits_to_float(lo), bits_to_float(static_cast<uint16_t>(lo + ((u & 0xFFFFu) ? 1 : 0)))};
}

TEST(StochasticRounding, PicksANeighbourWithOddsThatMakeItUnbiased) {
  for (const float x : {1.0f + 0.3f * 0x1p-7f, -3.7f, 0.001234f, -1e-30f, 0x1.fffp+10f}) {
    const auto [lo, hi] = neighbours(x);
    const int n = 200000;
    int up = 0;
    double sum = 0;
    for (int i = 0; i < n; ++i) {
      const float r = bits_to_float(sr::round_bits(x, sr::bits(7, 3, static_cast<uint64_t>(i))));
      ASSERT_TRUE(r == lo || r == hi) << x << " -> " << r;
      up += r == hi && hi != lo;
      sum += r;
    }
    const double p = (static_cast<double>(x) - lo) / (static_cast<double>(hi) - lo);
    const double sigma = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(static_cast<double>(up) / n, p, 5 * sigma + 1e-12) << x;
    EXPECT_NEAR(sum / n, x, 5 * sigma * std::fabs(hi - lo) + 1e-30) << x;
  }
}

TEST(StochasticRounding, KeepsBf16ValuesInfNanAndSaturatesAtTheLargestFinite) {
  for (const uint16_t b : {uint16_t{0x3F80}, uint16_t{0xC2F7}, uint16_t{0x0000}, uint16_t{0x8000}, uint16_t{0x0001}})
    for (const uint32_t r : {0u, 1u, 0x7FFFu, 0xFFFFu}) EXPECT_EQ(sr::round_bits(bits_to_float(b), r), b);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(sr::round_bits(inf, 0xFFFFu), 0x7F80);
  EXPECT_EQ(sr::round_bits(-inf, 0xFFFFu), 0xFF80);
  EXPECT_TRUE(std::isnan(bits_to_float(sr::round_bits(std::nanf(""), 0xFFFFu))));
  const float largest = std::numeric_limits<float>::max();  // past bf16's largest finite
  EXPECT_EQ(sr::round_bits(largest, 0xFFFFu), 0x7F7F);
  EXPECT_EQ(sr::round_bits(-largest, 0xFFFFu), 0xFF7F);
}

TEST(StochasticRounding, BitsArePhiloxWordsOfSeedStepAndIndex) {
  for (uint64_t i = 0; i < 64; ++i) {
    const philox::Words w = sr::bits4(11, 5, i / 4);
    EXPECT_EQ(sr::bits(11, 5, i), w.w[i % 4] & 0xFFFFu);
  }
  int same_step = 0, same_seed = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    same_step += sr::bits(11, 5, i) == sr::bits(11, 6, i);
    same_seed += sr::bits(11, 5, i) == sr::bits(12, 5, i);
  }
  EXPECT_LT(same_step, 5);  // 1000 / 65536 expected
  EXPECT_LT(same_seed, 5);
}

Tensor bf16_tensor(const std::vector<float>& values) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, DType::BF16);
  for (size_t i = 0; i < values.size(); ++i) t.data<BFloat16>()[i] = to_bf16(values[i]);
  return t;
}

Tensor f32_tensor(const std::vector<float>& values) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

std::vector<float> random_values(int64_t n, Rng& rng, double scale = 1.0) {
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = static_cast<float>(scale * rng.normal());
  return v;
}

TEST(AdamWBf16Master, TheFp32UpdateRoundedToANeighbourWithTheFp32Moments) {
  Rng rng(3);
  const int64_t n = 4099;
  Tensor param = bf16_tensor(random_values(n, rng));
  Tensor master = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) master.data<float>()[i] = to_float(param.data<BFloat16>()[i]);
  Tensor m = Tensor::zeros({n}), v = Tensor::zeros({n}), m32 = Tensor::zeros({n}), v32 = Tensor::zeros({n});
  for (int64_t step = 1; step <= 4; ++step) {
    const Tensor grad = f32_tensor(random_values(n, rng));
    AdamWHyper h{1e-2, 0.9, 0.95, 1e-8, 0.1, step, step == 2 ? 0.5f : 1.0f};
    h.rounding_seed = 99;
    // The fp32 reference starts from this step's bf16 weights.
    for (int64_t i = 0; i < n; ++i) master.data<float>()[i] = to_float(param.data<BFloat16>()[i]);
    adamw_update(master, grad, m32, v32, h);
    adamw_update(param, grad, m, v, h);
    for (int64_t i = 0; i < n; ++i) {
      const auto [lo, hi] = neighbours(master.data<float>()[i]);
      const float got = to_float(param.data<BFloat16>()[i]);
      ASSERT_TRUE(got == lo || got == hi) << "step " << step << " element " << i;
    }
    EXPECT_EQ(std::memcmp(m.data<float>(), m32.data<float>(), m.nbytes()), 0) << step;
    EXPECT_EQ(std::memcmp(v.data<float>(), v32.data<float>(), v.nbytes()), 0) << step;
  }
}

TEST(AdamWBf16Master, SplittingIntoCallsAtTheirOffsetsChangesNoBit) {
  Rng rng(4);
  const int64_t n = 1000, cut = 333;
  const std::vector<float> start = random_values(n, rng), g = random_values(n, rng);
  Tensor whole = bf16_tensor(start), split = bf16_tensor(start);
  Tensor m1 = Tensor::zeros({n}), v1 = Tensor::zeros({n}), m2 = Tensor::zeros({n}), v2 = Tensor::zeros({n});
  const Tensor grad = f32_tensor(g);
  AdamWHyper h{1e-3, 0.9, 0.999, 1e-8, 0.0, 7};
  h.rounding_seed = 5;
  h.rounding_offset = 40;
  adamw_update(whole, grad, m1, v1, h);
  adamw_update(split.narrow(0, cut), grad.narrow(0, cut), m2.narrow(0, cut), v2.narrow(0, cut), h);
  h.rounding_offset = 40 + cut;
  adamw_update(split.narrow(cut, n), grad.narrow(cut, n), m2.narrow(cut, n), v2.narrow(cut, n), h);
  EXPECT_EQ(std::memcmp(whole.raw(), split.raw(), whole.nbytes()), 0);
  // Another offset draws other bits: some weights land on the other neighbour.
  Tensor shifted = bf16_tensor(start);
  Tensor m3 = Tensor::zeros({n}), v3 = Tensor::zeros({n});
  h.rounding_offset = 41;
  adamw_update(shifted, grad, m3, v3, h);
  EXPECT_NE(std::memcmp(whole.raw(), shifted.raw(), whole.nbytes()), 0);
}

TEST(AdamWBf16Master, UpdatesBelowAnUlpAddUpAsTheFp32MastersDo) {
  // Weights at 1 (a bf16 ulp of 2^-7 = 0.0078 above, half that below) and a constant
  // gradient: AdamW moves each by lr per step, 1e-4, a 39th of the ulp below 1. Rounded to
  // nearest, nothing would ever move; stochastically, the mean follows the fp32 masters.
  const int64_t n = 20000, steps = 60;
  Tensor param = bf16_tensor(std::vector<float>(static_cast<size_t>(n), 1.0f));
  Tensor master = f32_tensor(std::vector<float>(static_cast<size_t>(n), 1.0f));
  Tensor m = Tensor::zeros({n}), v = Tensor::zeros({n}), m32 = Tensor::zeros({n}), v32 = Tensor::zeros({n});
  const Tensor grad = f32_tensor(std::vector<float>(static_cast<size_t>(n), 0.25f));
  for (int64_t step = 1; step <= steps; ++step) {
    AdamWHyper h{1e-4, 0.9, 0.999, 1e-8, 0.0, step};
    h.rounding_seed = 17;
    adamw_update(param, grad, m, v, h);
    adamw_update(master, grad, m32, v32, h);
  }
  double mean = 0;
  for (int64_t i = 0; i < n; ++i) mean += to_float(param.data<BFloat16>()[i]);
  mean /= static_cast<double>(n);
  const double expected = master.data<float>()[0];
  EXPECT_NEAR(expected, 1.0 - 60e-4, 1e-5);
  // Each weight's rounding errors (at most an ulp, 2^-8 below 1, per step) are independent
  // of the others' (their bits are): the mean's error is a small fraction of the 0.006 moved.
  EXPECT_NEAR(mean, expected, 2e-4);
}

TEST(AdamWBf16Master, RefusesACopyAndNegativeOffsets) {
  Tensor param = bf16_tensor({1.0f, 2.0f}), grad = f32_tensor({0.1f, 0.2f});
  Tensor m = Tensor::zeros({2}), v = Tensor::zeros({2});
  AdamWHyper h;
  h.rounding_offset = -1;
  EXPECT_THROW(adamw_update(param, grad, m, v, h), Error);
  h.rounding_offset = 0;
  EXPECT_THROW(adamw_update(param, grad, m, v, h, Tensor::empty({2}, DType::BF16)), Error);
  EXPECT_THROW(adamw_update(Tensor::empty({2}, DType::F16), grad, m, v, h), Error);
}

}  // namespace
}  // namespace forge
