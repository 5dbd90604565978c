#include <gtest/gtest.h>

#include <cmath>

#include "ops/rope.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

// Llama 3.1 8B: rope_theta 500000, head_dim 128, rope_scaling {factor 8, low_freq_factor 1,
// high_freq_factor 4, original_max_position_embeddings 8192}. Expected values were derived
// by hand from the formula of transformers' _compute_llama3_parameters, in double:
// index 28 is the last unscaled frequency (wavelength < 2048), 29..34 are interpolated,
// 35 and up are divided by 8 (wavelength > 8192).
TEST(OpsRope, Llama31InverseFrequencies) {
  RopeScaling scaling{.enabled = true, .factor = 8.0, .low_freq_factor = 1.0, .high_freq_factor = 4.0,
                      .original_max_position = 8192};
  std::vector<double> inv_freq = rope_inv_freq(128, 500000.0, scaling);
  ASSERT_EQ(inv_freq.size(), 64u);
  const std::pair<int, double> expected[] = {
      {0, 1.0},
      {1, 0.8146172338565447},
      {28, 0.0032114459947525913},
      {29, 0.002166570763503359},
      {30, 0.0013718935677611381},
      {32, 0.0005248461609929547},
      {34, 0.00017850781276799638},
      {35, 9.556212353964683e-05},
      {49, 5.415469365499923e-06},
      {63, 3.068925988914511e-07},
  };
  for (auto [i, want] : expected) EXPECT_NEAR(inv_freq[i] / want, 1.0, 1e-12) << "index " << i;
}

// DeepSeek-V2-Lite's YaRN: qk_rope_head_dim 64, rope_theta 10000, rope_scaling {type yarn,
// factor 40, original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale and
// mscale_all_dim 0.707}. Expected values from transformers 5.23's
// ROPE_INIT_FUNCTIONS["yarn"] (computed in fp32, hence 1e-6) and, for the softmax scale,
// its DeepSeek-V2 yarn_apply_mscale.
TEST(OpsRope, YarnMatchesTransformers) {
  RopeScaling s;
  s.enabled = true;
  s.type = "yarn";
  s.factor = 40.0;
  s.original_max_position = 4096;
  s.mscale = s.mscale_all_dim = 0.707;
  const std::vector<double> inv_freq = rope_inv_freq(64, 10000.0, s);
  ASSERT_EQ(inv_freq.size(), 32u);
  const std::pair<int, double> expected[] = {
      {0, 1.0},  {5, 0.23713736236095428},  {10, 0.05623412877321243},  {15, 0.0083345090970397},
      {20, 0.0007905694073997438}, {25, 1.8747354260995053e-05}, {31, 3.3338035336782923e-06},
  };
  for (auto [i, want] : expected) EXPECT_NEAR(inv_freq[i] / want, 1.0, 1e-6) << "index " << i;
  EXPECT_DOUBLE_EQ(rope_attention_factor(s), 1.0);  // equal mscales cancel
  EXPECT_NEAR(rope_softmax_scale(s), 1.5896261651208736, 1e-12);
  s.mscale = 1.0;
  s.mscale_all_dim = 0.8;
  EXPECT_NEAR(rope_attention_factor(s), 1.0569662567531275, 1e-12);
  EXPECT_NEAR(rope_softmax_scale(s), 1.677310835070927, 1e-12);
  s.enabled = false;  // the factors only apply while scaling is on
  EXPECT_EQ(rope_attention_factor(s), 1.0);
  EXPECT_EQ(rope_softmax_scale(s), 1.0);
}

// The tables carry the attention factor: cos and sin scaled alike.
TEST(OpsRope, TablesTakeAScale) {
  Tensor cos, sin, cos2, sin2;
  const std::vector<double> inv_freq = rope_inv_freq(8, 10000.0, RopeScaling{});
  rope_tables(cos, sin, inv_freq, 5);
  rope_tables(cos2, sin2, inv_freq, 5, 1.25);
  for (int64_t i = 0; i < cos.numel(); ++i) {
    EXPECT_FLOAT_EQ(cos2.data<float>()[i], static_cast<float>(1.25 * cos.data<float>()[i]));
    EXPECT_FLOAT_EQ(sin2.data<float>()[i], static_cast<float>(1.25 * sin.data<float>()[i]));
  }
}

TEST(OpsRope, UnscaledInverseFrequencies) {
  std::vector<double> inv_freq = rope_inv_freq(8, 10000.0, RopeScaling{});
  const double expected[] = {1.0, 0.1, 0.01, 0.001};
  ASSERT_EQ(inv_freq.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(inv_freq[i] / expected[i], 1.0, 1e-12) << i;
}

TEST(OpsRope, TablesHoldCosAndSinOfPositionTimesFrequency) {
  std::vector<double> inv_freq = rope_inv_freq(16, 500000.0, RopeScaling{});
  Tensor cos, sin;
  rope_tables(cos, sin, inv_freq, 9000);
  ASSERT_EQ(cos.shape(), (Shape{9000, 8}));
  ASSERT_EQ(sin.shape(), (Shape{9000, 8}));
  for (int64_t t : {0, 1, 77, 8999}) {
    for (int64_t i = 0; i < 8; ++i) {
      double angle = static_cast<double>(t) * inv_freq[i];
      EXPECT_EQ(cos.data<float>()[t * 8 + i], static_cast<float>(std::cos(angle)));
      EXPECT_EQ(sin.data<float>()[t * 8 + i], static_cast<float>(std::sin(angle)));
    }
  }
}

// The rotate-half rotation of the first `rotated` heads, in double, at position t (or
// positions[b * seq + t]).
std::vector<double> naive_rope(const Tensor& x, int64_t rotated, const std::vector<double>& inv_freq,
                               const int32_t* positions = nullptr) {
  int64_t batch = x.dim(0), seq = x.dim(1), heads = x.dim(2), dim = x.dim(3), half = dim / 2;
  std::vector<double> out = testing::to_double(x);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < seq; ++t) {
      for (int64_t h = 0; h < rotated; ++h) {
        double* v = out.data() + ((b * seq + t) * heads + h) * dim;
        const double p = positions ? positions[b * seq + t] : static_cast<double>(t);
        for (int64_t i = 0; i < half; ++i) {
          double c = std::cos(p * inv_freq[i]), s = std::sin(p * inv_freq[i]);
          double lo = v[i], hi = v[i + half];
          v[i] = lo * c - hi * s;
          v[i + half] = hi * c + lo * s;
        }
      }
    }
  }
  return out;
}

struct RopeCase {
  int64_t batch, seq, heads, rotated, dim;
};

const RopeCase kCases[] = {{1, 1, 1, 1, 2}, {2, 7, 5, 3, 8}, {1, 13, 3, 3, 6}, {2, 5, 4, 0, 4}};

TEST(OpsRope, ForwardMatchesDoublePrecision) {
  Rng rng(61);
  for (const RopeCase& c : kCases) {
    std::vector<double> inv_freq = rope_inv_freq(c.dim, 100.0, RopeScaling{});
    Tensor cos, sin;
    rope_tables(cos, sin, inv_freq, c.seq + 3);
    Tensor x = random_tensor({c.batch, c.seq, c.heads, c.dim}, rng);
    std::vector<double> want = naive_rope(x, c.rotated, inv_freq);
    rope_forward(x, c.rotated, cos, sin);
    EXPECT_LT(relative_error(x, want), 1e-5) << c.batch << "," << c.seq << "," << c.heads << "," << c.dim;
  }
}

// Packed examples (NOTE [Packed examples]): each token rotated by its given position.
TEST(OpsRope, ExplicitPositionsRotateByThePositionGiven) {
  Rng rng(64);
  for (const RopeCase& c : kCases) {
    std::vector<double> inv_freq = rope_inv_freq(c.dim, 100.0, RopeScaling{});
    Tensor cos, sin;
    rope_tables(cos, sin, inv_freq, c.seq);
    Tensor positions = Tensor::empty({c.batch, c.seq}, DType::I32);
    for (int64_t i = 0; i < positions.numel(); ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(rng.below(c.seq));
    Tensor x = random_tensor({c.batch, c.seq, c.heads, c.dim}, rng);
    Tensor original = x.clone();
    std::vector<double> want = naive_rope(x, c.rotated, inv_freq, positions.data<int32_t>());
    rope_forward(x, c.rotated, cos, sin, &positions);
    EXPECT_LT(relative_error(x, want), 1e-5) << c.batch << "," << c.seq << "," << c.heads << "," << c.dim;
    rope_backward(x, c.rotated, cos, sin, &positions);
    EXPECT_LT(relative_error(x, testing::to_double(original)), 1e-5);
  }
  // Positions 0, 1, ... are the default rotation, bit for bit.
  std::vector<double> inv_freq = rope_inv_freq(8, 10000.0, RopeScaling{});
  Tensor cos, sin;
  rope_tables(cos, sin, inv_freq, 9);
  Tensor positions = Tensor::empty({2, 9}, DType::I32);
  for (int64_t i = 0; i < 18; ++i) positions.data<int32_t>()[i] = static_cast<int32_t>(i % 9);
  Tensor a = random_tensor({2, 9, 3, 8}, rng), b = a.clone();
  rope_forward(a, 2, cos, sin);
  rope_forward(b, 2, cos, sin, &positions);
  EXPECT_TRUE(testing::bitwise_equal(a, b));
  positions.data<int32_t>()[4] = 9;
  EXPECT_THROW(rope_forward(b, 2, cos, sin, &positions), Error);
}

TEST(OpsRope, BackwardMatchesFiniteDifferences) {
  Rng rng(62);
  for (const RopeCase& c : kCases) {
    std::vector<double> inv_freq = rope_inv_freq(c.dim, 100.0, RopeScaling{});
    Tensor cos, sin;
    rope_tables(cos, sin, inv_freq, c.seq);
    Tensor x = random_tensor({c.batch, c.seq, c.heads, c.dim}, rng);
    Tensor r = random_tensor(x.shape(), rng);
    Tensor rotated = Tensor::empty(x.shape());
    auto loss = [&] {
      rotated.copy_from(x);
      rope_forward(rotated, c.rotated, cos, sin);
      return testing::weighted_sum(rotated, r);
    };
    std::vector<double> fd = testing::finite_difference(x, loss);
    Tensor grad = r.clone();
    rope_backward(grad, c.rotated, cos, sin);
    EXPECT_LT(relative_error(grad, fd), 1e-2) << c.batch << "," << c.seq << "," << c.heads << "," << c.dim;
  }
}

TEST(OpsRope, BackwardUndoesForward) {
  Rng rng(63);
  std::vector<double> inv_freq = rope_inv_freq(32, 10000.0, RopeScaling{});
  Tensor cos, sin;
  rope_tables(cos, sin, inv_freq, 64);
  Tensor x = random_tensor({2, 64, 6, 32}, rng);
  Tensor y = x.clone();
  rope_forward(y, 4, cos, sin);
  rope_backward(y, 4, cos, sin);
  EXPECT_LT(relative_error(y, testing::to_double(x)), 1e-5);
}

TEST(OpsRope, RejectsTablesThatDoNotFit) {
  Tensor cos, sin;
  rope_tables(cos, sin, rope_inv_freq(4, 10000.0, RopeScaling{}), 3);
  Tensor x = Tensor::zeros({1, 4, 2, 4});
  EXPECT_THROW(rope_forward(x, 2, cos, sin), Error);
  EXPECT_THROW(rope_forward(x.view({1, 2, 2, 8}), 1, cos, sin), Error);
}

}  // namespace
}  // namespace forge
