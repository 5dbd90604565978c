#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "expect_error.h"
#include "kernels/philox.h"
#include "ops/random_normal.h"
#include "ops_testing.h"

namespace forge {
namespace {

struct KnownAnswer {
  uint32_t counter[4], key[2], expected[4];
};

// Random123's kat_vectors, philox4x32 with 10 rounds.
TEST(OpsRandomNormal, PhiloxMatchesRandom123KnownAnswers) {
  const KnownAnswer cases[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const KnownAnswer& c : cases) {
    const philox::Words out = philox::philox4x32_10(
        philox::Words{{c.counter[0], c.counter[1], c.counter[2], c.counter[3]}}, c.key[0], c.key[1]);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out.w[i], c.expected[i]) << std::hex << c.counter[0] << " word " << i;
  }
}

// Element k of the stream is the Box-Muller number the header defines, bit for bit.
TEST(OpsRandomNormal, ElementsFollowTheDefinition) {
  const uint64_t seed = 0x0123456789abcdefull;
  Tensor out = Tensor::empty({10});
  random_normal(out, seed, 6);
  for (int64_t i = 0; i < 10; ++i) {
    const uint64_t k = 6 + static_cast<uint64_t>(i), block = k / 4;
    const philox::Words x = philox::philox4x32_10(
        philox::Words{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), 0, 0}},
        static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    const int pair = static_cast<int>(k % 4) / 2;
    const double u = ((x.w[2 * pair] >> 8) + 1) * 0x1p-24, v = (x.w[2 * pair + 1] >> 8) * 0x1p-24;
    const double r = std::sqrt(-2.0 * std::log(u)), theta = 2.0 * M_PI * v;
    EXPECT_NEAR(out.data<float>()[i], k % 2 == 0 ? r * std::cos(theta) : r * std::sin(theta), 2e-6) << k;
  }
}

double standard_normal_cdf(double x) { return 0.5 * std::erfc(-x / std::sqrt(2.0)); }

TEST(OpsRandomNormal, MillionDrawsLookNormal) {
  const int64_t n = 1000000;
  Tensor out = Tensor::empty({n});
  random_normal(out, 42, 0);
  std::vector<double> z = testing::to_double(out);
  double mean = 0, m2 = 0, m3 = 0, m4 = 0, lag = 0;
  for (double v : z) mean += v;
  mean /= n;
  for (size_t i = 0; i < z.size(); ++i) {
    const double d = z[i] - mean;
    m2 += d * d;
    m3 += d * d * d;
    m4 += d * d * d * d;
    if (i + 1 < z.size()) lag += d * (z[i + 1] - mean);
  }
  m2 /= n;
  m3 /= n;
  m4 /= n;
  // Each bound is about 5 standard errors of the statistic for n = 1e6.
  EXPECT_LT(std::abs(mean), 5e-3);
  EXPECT_LT(std::abs(m2 - 1.0), 7e-3);
  EXPECT_LT(std::abs(m3 / std::pow(m2, 1.5)), 1.2e-2);
  EXPECT_LT(std::abs(m4 / (m2 * m2) - 3.0), 2.5e-2);
  EXPECT_LT(std::abs(lag / (n * m2)), 5e-3);  // neighbours (lanes of a block, pairs) uncorrelated
  // Kolmogorov-Smirnov: the largest gap to the normal CDF, below the 1% critical value 1.63 / sqrt(n).
  std::sort(z.begin(), z.end());
  double gap = 0;
  for (size_t i = 0; i < z.size(); ++i) {
    const double f = standard_normal_cdf(z[i]);
    gap = std::max({gap, std::abs(f - static_cast<double>(i) / n), std::abs(f - static_cast<double>(i + 1) / n)});
  }
  EXPECT_LT(gap, 1.63 / std::sqrt(static_cast<double>(n)));
  EXPECT_LE(z.back(), 5.78);  // the 24-bit uniform's bound, sqrt(48 ln 2)
}

TEST(OpsRandomNormal, OffsetsContinueTheSameStream) {
  const uint64_t seed = 7;
  Tensor whole = Tensor::empty({20011});
  random_normal(whole, seed, 0);
  for (int64_t offset : {1, 2, 3, 4, 5, 8, 4097, 19999}) {
    for (int64_t n : {1, 3, 4, 9}) {
      Tensor part = Tensor::empty({n});
      random_normal(part, seed, static_cast<uint64_t>(offset));
      EXPECT_TRUE(testing::bitwise_equal(part, whole.narrow(offset, offset + n))) << offset << " " << n;
    }
  }
  Tensor tail = Tensor::empty({20011 - 13});
  random_normal(tail, seed, 13);
  EXPECT_TRUE(testing::bitwise_equal(tail, whole.narrow(13, 20011)));
}

TEST(OpsRandomNormal, SeedsGiveDifferentStreams) {
  Tensor a = Tensor::empty({64}), b = Tensor::empty({64}), c = Tensor::empty({64}), again = Tensor::empty({64});
  random_normal(a, 1, 0);
  random_normal(b, 2, 0);
  random_normal(c, 1 + (uint64_t{1} << 32), 0);  // the key's high word counts too
  random_normal(again, 1, 0);
  EXPECT_TRUE(testing::bitwise_equal(a, again));
  EXPECT_FALSE(testing::bitwise_equal(a, b));
  EXPECT_FALSE(testing::bitwise_equal(a, c));
  Tensor far = Tensor::empty({8});  // blocks past 2^32 use the counter's second word
  random_normal(far, 1, uint64_t{4} << 32);
  EXPECT_FALSE(testing::bitwise_equal(far, a.narrow(0, 8)));
}

TEST(OpsRandomNormal, RejectsNonF32OnTheCpuAndTheStreamsEnd) {
  expect_error([] { random_normal(Tensor::zeros({4}, DType::BF16), 1, 0); }, {"random_normal out", "bf16"});
  expect_error([] { random_normal(Tensor::zeros({4}), 1, ~uint64_t{0} - 2); }, {"random_normal", "end of the stream"});
}

}  // namespace
}  // namespace forge
