#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "optim/optimizer.h"

namespace forge {
namespace {

Tensor filled(Shape shape, std::initializer_list<float> values) {
  Tensor t = Tensor::empty(std::move(shape));
  float* p = t.data<float>();
  for (float v : values) *p++ = v;
  return t;
}

TEST(OptimClip, GlobalNormOverAllTensors) {
  // Norm of (3, 4) and (12) is 13.
  std::vector<Tensor> grads = {filled({2}, {3.0f, 4.0f}), filled({1}, {12.0f})};
  EXPECT_DOUBLE_EQ(global_grad_norm(grads), 13.0);
  EXPECT_EQ(grads[0].data<float>()[0], 3.0f);  // measuring leaves the grads alone
}

TEST(OptimClip, CoefficientAboveMaxIsTorchs) {
  EXPECT_EQ(clip_coefficient(13.0, 1.0), (1.0f / (13.0f + 1e-6f)) * 1.0f);
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0f);
}

TEST(OptimClip, FollowsTorchEpsilonAtTheBoundary) {
  // torch scales whenever max_norm / (norm + 1e-6) < 1, so a norm equal to max_norm is
  // scaled by a hair.
  const float c = clip_coefficient(2.0, 2.0);
  EXPECT_EQ(c, (1.0f / (2.0f + 1e-6f)) * 2.0f);
  EXPECT_LT(c, 1.0f);
}

TEST(OptimClip, ZeroMaxNormOnlyMeasures) { EXPECT_EQ(clip_coefficient(50.0, 0.0), 1.0f); }

TEST(OptimClip, NonFiniteNormIsReportedAndNotApplied) {
  float inf = std::numeric_limits<float>::infinity();
  std::vector<Tensor> grads = {filled({2}, {1.0f, inf}), filled({1}, {5.0f})};
  EXPECT_TRUE(std::isinf(global_grad_norm(grads)));
  EXPECT_EQ(clip_coefficient(global_grad_norm(grads), 1.0), 1.0f);
  grads[0].data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(global_grad_norm(grads)));
  EXPECT_EQ(clip_coefficient(global_grad_norm(grads), 1.0), 1.0f);
}

TEST(OptimClip, AdamWAppliesTheCoefficientAsTorchsInPlaceScaleWould) {
  // Clipping inside AdamW (g * coef as it is read) gives bit for bit the update of
  // scaling the grads first and stepping with coefficient 1.
  OptimizerConfig config;
  config.lr = 1e-2;
  std::vector<Tensor> p1 = {filled({3}, {0.5f, -1.0f, 2.0f})}, p2 = {filled({3}, {0.5f, -1.0f, 2.0f})};
  std::vector<Tensor> g = {filled({3}, {3.0f, -7.0f, 11.0f})};
  const float coef = clip_coefficient(global_grad_norm(g), 1.0);
  ASSERT_LT(coef, 1.0f);
  AdamW fused(config, p1, {true}), separate(config, p2, {true});
  fused.step(g, config.lr, coef);
  std::vector<Tensor> scaled = {filled({3}, {3.0f * coef, -7.0f * coef, 11.0f * coef})};
  separate.step(scaled, config.lr);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(p1[0].data<float>()[i], p2[0].data<float>()[i]) << i;
  EXPECT_EQ(g[0].data<float>()[0], 3.0f);
}

}  // namespace
}  // namespace forge
