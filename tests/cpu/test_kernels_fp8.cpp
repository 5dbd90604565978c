// The FP8 CPU reference (kernels/cpu/fp8.h, fp8_scaling.h) against the formulas it cites:
// Transformer Engine's delayed scaling (history roll, max / most_recent, margin, a spike
// that leaves the window), TE's current/block scale rule at its edges, quantize/dequantize
// round trips per block shape, and the reference FP8 matmul against the product of the
// dequantized operands and, within FP8's precision, against the fp32 product. The casts
// and torchao's scales are compared with PyTorch bit for bit in
// tests/python/test_fp8_vs_torch.py.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cpu/fp8_scaling.h"

namespace forge::cpu {
namespace {

TEST(Fp8Format, LargestFiniteAndSmallestSubnormal) {
  EXPECT_EQ(fp8_from_float(448.0f, Fp8Format::E4M3), 0x7e);
  EXPECT_EQ(fp8_from_float(-448.0f, Fp8Format::E4M3), 0xfe);
  EXPECT_EQ(fp8_from_float(57344.0f, Fp8Format::E5M2), 0x7b);
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::E4M3), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_to_float(0x01, Fp8Format::E5M2), std::ldexp(1.0f, -16));
  EXPECT_TRUE(std::isnan(fp8_to_float(0x7f, Fp8Format::E4M3)));
  EXPECT_TRUE(std::isinf(fp8_to_float(0xfc, Fp8Format::E5M2)));
}

TEST(Fp8Format, SaturatingCastClampsOverflowAndInfinityButKeepsNan) {
  EXPECT_EQ(fp8_from_float(500.0f, Fp8Format::E4M3), 0x7f);  // plain: NaN
  EXPECT_EQ(fp8_from_float_saturated(500.0f, Fp8Format::E4M3), 0x7e);
  EXPECT_EQ(fp8_from_float_saturated(-INFINITY, Fp8Format::E4M3), 0xfe);
  EXPECT_EQ(fp8_from_float(1e6f, Fp8Format::E5M2), 0x7c);  // plain: inf
  EXPECT_EQ(fp8_from_float_saturated(1e6f, Fp8Format::E5M2), 0x7b);
  EXPECT_EQ(fp8_from_float_saturated(NAN, Fp8Format::E5M2), 0x7f);
}

TEST(Fp8Format, EveryFiniteCodeRoundTrips) {
  for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2})
    for (int code = 0; code < 256; ++code) {
      const float v = fp8_to_float(static_cast<uint8_t>(code), format);
      if (!std::isfinite(v)) continue;
      EXPECT_EQ(fp8_from_float_saturated(v, format), code) << fp8_format_name(format) << " code " << code;
    }
}

TEST(Fp8Scaling, DelayedScalingFollowsTransformerEngine) {
  // history[0] is this step's amax; the window holds 4.
  std::vector<float> history{3.0f, 8.0f, 1.0f, 2.0f};
  float scale = fp8_delayed_scale_update(history.data(), 4, 1.0f, Fp8AmaxAlgorithm::Max, 0.0f, Fp8Format::E4M3);
  EXPECT_EQ(scale, 448.0f / 8.0f);
  EXPECT_EQ(history, (std::vector<float>{0.0f, 1.0f, 2.0f, 3.0f}));  // rolled, newest at the end, slot 0 free

  history = {3.0f, 8.0f, 1.0f, 2.0f};
  scale = fp8_delayed_scale_update(history.data(), 4, 1.0f, Fp8AmaxAlgorithm::MostRecent, 2.0f, Fp8Format::E5M2);
  EXPECT_EQ(scale, 57344.0f * 0.25f / 3.0f);

  // A spike leaves the scale once it has rolled out of the window.
  history = {0.0f, 0.0f, 0.0f};
  std::vector<float> scales;
  for (float amax : {1.0f, 100.0f, 1.0f, 1.0f, 1.0f, 1.0f}) {
    history[0] = amax;
    scales.push_back(fp8_delayed_scale_update(history.data(), 3, 1.0f, Fp8AmaxAlgorithm::Max, 0.0f, Fp8Format::E4M3));
  }
  EXPECT_EQ(scales, (std::vector<float>{448.0f, 4.48f, 4.48f, 4.48f, 448.0f, 448.0f}));

  // An amax of 0, inf or NaN keeps the previous scale.
  for (float amax : {0.0f, INFINITY}) {
    history = {amax, 0.0f};
    EXPECT_EQ(fp8_delayed_scale_update(history.data(), 2, 7.0f, Fp8AmaxAlgorithm::MostRecent, 0.0f, Fp8Format::E4M3),
              7.0f);
  }
  history = {NAN};
  EXPECT_EQ(fp8_delayed_scale_update(history.data(), 1, 7.0f, Fp8AmaxAlgorithm::MostRecent, 0.0f, Fp8Format::E4M3),
            7.0f);
}

TEST(Fp8Scaling, TransformerEngineScaleRuleAtItsEdges) {
  EXPECT_EQ(fp8_scale_transformer_engine(0.0f, Fp8Format::E4M3, true, 0.0f, FLT_MAX), 1.0f);
  EXPECT_EQ(fp8_scale_transformer_engine(NAN, Fp8Format::E4M3, true, 0.0f, FLT_MAX), 1.0f);
  EXPECT_EQ(fp8_scale_transformer_engine(INFINITY, Fp8Format::E4M3, false, 0.0f, FLT_MAX), 1.0f);
  EXPECT_EQ(fp8_scale_transformer_engine(1e-45f, Fp8Format::E4M3, false, 0.0f, FLT_MAX), FLT_MAX);  // 448 / denormal
  EXPECT_EQ(fp8_scale_transformer_engine(3.0f, Fp8Format::E4M3, false, 0.0f, FLT_MAX), 448.0f / 3.0f);
  EXPECT_EQ(fp8_scale_transformer_engine(3.0f, Fp8Format::E4M3, true, 0.0f, FLT_MAX), 128.0f);  // 149.3 down
  EXPECT_EQ(fp8_scale_transformer_engine(1e-9f, Fp8Format::E4M3, false, 1e-6f, FLT_MAX), 448.0f / 1e-6f);
}

TEST(Fp8Scaling, TorchaoScaleRule) {
  EXPECT_EQ(fp8_scale_torchao(2.0f, Fp8Format::E4M3, false), 224.0f);
  EXPECT_EQ(fp8_scale_torchao(3.0f, Fp8Format::E4M3, true), 128.0f);
  EXPECT_EQ(fp8_scale_torchao(0.0f, Fp8Format::E4M3, false), static_cast<float>(448.0 / 1e-12));
  EXPECT_EQ(fp8_scale_torchao(INFINITY, Fp8Format::E5M2, false), 0.0f);
  EXPECT_TRUE(std::isnan(fp8_scale_torchao(NAN, Fp8Format::E5M2, false)));
}

std::vector<float> random_values(int64_t n, Rng& rng) {
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = static_cast<float>(rng.normal() * std::exp(2.0 * rng.normal()));  // wide magnitudes
  return x;
}

TEST(Fp8Scaling, QuantizeDequantizeStaysWithinHalfAStepOfEachBlock) {
  Rng rng(1501);
  const int64_t rows = 200, cols = 300;
  const std::vector<float> x = random_values(rows * cols, rng);
  for (Fp8Blocks blocks : {Fp8Blocks{rows, cols}, Fp8Blocks{1, cols}, Fp8Blocks{1, 128}, Fp8Blocks{128, 128}})
    for (Fp8Format format : {Fp8Format::E4M3, Fp8Format::E5M2}) {
      std::vector<float> amax(static_cast<size_t>(fp8_scale_count(rows, cols, blocks))), scales(amax.size());
      fp8_block_amax(x.data(), rows, cols, blocks, amax.data());
      for (size_t i = 0; i < amax.size(); ++i) scales[i] = fp8_scale_torchao(amax[i], format, false);
      std::vector<uint8_t> q(x.size());
      std::vector<float> back(x.size());
      fp8_quantize(x.data(), rows, cols, blocks, scales.data(), format, q.data());
      fp8_dequantize(q.data(), rows, cols, blocks, scales.data(), format, back.data());
      const int mantissa_bits = format == Fp8Format::E4M3 ? 3 : 2;
      const double min_normal = format == Fp8Format::E4M3 ? 0x1p-6 : 0x1p-14;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const size_t i = static_cast<size_t>(r * cols + c);
          const float s = scales[static_cast<size_t>((r / blocks.rows) * ((cols + blocks.cols - 1) / blocks.cols) +
                                                     c / blocks.cols)];
          const double scaled = std::fabs(static_cast<double>(x[i]) * s);
          const double step = std::ldexp(1.0, std::ilogb(std::max(scaled, min_normal)) - mantissa_bits);
          ASSERT_LE(std::fabs(static_cast<double>(back[i]) - x[i]) * s, 0.5 * step * (1 + 1e-6))
              << fp8_format_name(format) << " block " << blocks.rows << "x" << blocks.cols << " at " << r << "," << c;
        }
    }
}

TEST(Fp8Scaling, MatmulReferenceIsTheProductOfTheDequantizedOperands) {
  Rng rng(1502);
  const int64_t m = 37, n = 29, k = 300;
  const std::vector<float> a = random_values(m * k, rng), b = random_values(n * k, rng);
  struct Case {
    Fp8Blocks a_blocks, b_blocks;
    Fp8Format b_format;
  };
  for (const Case& c : {Case{{m, k}, {n, k}, Fp8Format::E4M3}, Case{{m, k}, {n, k}, Fp8Format::E5M2},
                        Case{{1, k}, {1, k}, Fp8Format::E4M3}, Case{{1, 128}, {128, 128}, Fp8Format::E4M3},
                        Case{{1, 128}, {1, 128}, Fp8Format::E5M2}}) {
    auto quantize = [&](const std::vector<float>& x, int64_t rows, Fp8Blocks blocks, Fp8Format format,
                        std::vector<uint8_t>& q, std::vector<float>& scales, std::vector<float>& deq) {
      std::vector<float> amax(static_cast<size_t>(fp8_scale_count(rows, k, blocks)));
      fp8_block_amax(x.data(), rows, k, blocks, amax.data());
      scales.resize(amax.size());
      for (size_t i = 0; i < amax.size(); ++i) scales[i] = fp8_scale_torchao(amax[i], format, true);
      q.resize(x.size());
      deq.resize(x.size());
      fp8_quantize(x.data(), rows, k, blocks, scales.data(), format, q.data());
      fp8_dequantize(q.data(), rows, k, blocks, scales.data(), format, deq.data());
    };
    std::vector<uint8_t> qa, qb;
    std::vector<float> sa, sb, da, db;
    quantize(a, m, c.a_blocks, Fp8Format::E4M3, qa, sa, da);
    quantize(b, n, c.b_blocks, c.b_format, qb, sb, db);
    std::vector<float> out(static_cast<size_t>(m * n));
    fp8_matmul_reference({qa.data(), Fp8Format::E4M3, sa.data(), c.a_blocks},
                         {qb.data(), c.b_format, sb.data(), c.b_blocks}, m, n, k, out.data());
    double err_deq = 0, err_fp32 = 0, norm = 0;
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double deq = 0, exact = 0;
        for (int64_t t = 0; t < k; ++t) {
          deq += static_cast<double>(da[i * k + t]) * db[j * k + t];
          exact += static_cast<double>(a[i * k + t]) * b[j * k + t];
        }
        const double got = out[static_cast<size_t>(i * n + j)];
        err_deq = std::max(err_deq, std::fabs(got - deq) / (std::fabs(deq) + 1e-30));
        err_fp32 += (got - exact) * (got - exact);
        norm += exact * exact;
      }
    // Power-of-2 scales make 1 / scale and the division in dequantize exact: the two agree
    // to the final rounding to fp32 (and the order of the double sums).
    EXPECT_LT(err_deq, 1e-6) << "blocks " << c.a_blocks.cols << " / " << c.b_blocks.cols;
    // FP8 keeps 3 (E4M3) or 2 (E5M2) mantissa bits: each operand is off by up to 2^-4 or
    // 2^-3 relative, mostly cancelling over k = 300.
    EXPECT_LT(std::sqrt(err_fp32 / norm), c.b_format == Fp8Format::E4M3 ? 0.05 : 0.08)
        << "blocks " << c.a_blocks.cols << " / " << c.b_blocks.cols;
  }
}

}  // namespace
}  // namespace forge::cpu
