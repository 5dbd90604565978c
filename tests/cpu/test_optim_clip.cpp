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

TEST(OptimClip, ReturnsGlobalNormAndScalesAboveMax) {
  // Norm of (3, 4) and (12) is 13.
  std::vector<Tensor> grads = {filled({2}, {3.0f, 4.0f}), filled({1}, {12.0f})};
  double norm = clip_grad_norm(grads, 1.0);
  EXPECT_DOUBLE_EQ(norm, 13.0);
  float coefficient = 1.0f / (13.0f + 1e-6f);
  EXPECT_FLOAT_EQ(grads[0].data<float>()[0], 3.0f * coefficient);
  EXPECT_FLOAT_EQ(grads[0].data<float>()[1], 4.0f * coefficient);
  EXPECT_FLOAT_EQ(grads[1].data<float>()[0], 12.0f * coefficient);
  EXPECT_NEAR(clip_grad_norm(grads, 0.0), 1.0, 1e-6);
}

TEST(OptimClip, LeavesGradsBelowMaxUntouched) {
  std::vector<Tensor> grads = {filled({2}, {0.3f, 0.4f})};
  EXPECT_NEAR(clip_grad_norm(grads, 1.0), 0.5, 1e-7);
  EXPECT_EQ(grads[0].data<float>()[0], 0.3f);
  EXPECT_EQ(grads[0].data<float>()[1], 0.4f);
}

TEST(OptimClip, FollowsTorchEpsilonAtTheBoundary) {
  // torch scales whenever max_norm / (norm + 1e-6) < 1, so a norm equal to max_norm is
  // scaled by a hair.
  std::vector<Tensor> grads = {filled({1}, {2.0f})};
  EXPECT_DOUBLE_EQ(clip_grad_norm(grads, 2.0), 2.0);
  EXPECT_EQ(grads[0].data<float>()[0], 2.0f * ((1.0f / (2.0f + 1e-6f)) * 2.0f));
  EXPECT_LT(grads[0].data<float>()[0], 2.0f);
}

TEST(OptimClip, ZeroMaxNormOnlyMeasures) {
  std::vector<Tensor> grads = {filled({2}, {30.0f, 40.0f})};
  EXPECT_DOUBLE_EQ(clip_grad_norm(grads, 0.0), 50.0);
  EXPECT_EQ(grads[0].data<float>()[1], 40.0f);
}

TEST(OptimClip, NonFiniteNormLeavesGrads) {
  float inf = std::numeric_limits<float>::infinity();
  std::vector<Tensor> grads = {filled({2}, {1.0f, inf}), filled({1}, {5.0f})};
  EXPECT_TRUE(std::isinf(clip_grad_norm(grads, 1.0)));
  EXPECT_EQ(grads[0].data<float>()[0], 1.0f);
  EXPECT_EQ(grads[1].data<float>()[0], 5.0f);

  grads[0].data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(clip_grad_norm(grads, 1.0)));
  EXPECT_EQ(grads[1].data<float>()[0], 5.0f);
}

}  // namespace
}  // namespace forge
