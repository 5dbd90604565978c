#include <gtest/gtest.h>

#include <cmath>

#include "ops/adamw.h"
#include "optim/optimizer.h"

namespace forge {
namespace {

Tensor scalar_tensor(float value) {
  Tensor t = Tensor::empty({1});
  t.data<float>()[0] = value;
  return t;
}

TEST(OptimAdamW, FirstStepMovesByLrTimesSignOfGrad) {
  // After one step m / (1 - beta1) = g and sqrt(v / (1 - beta2)) = |g|, so the update is
  // lr * g / (|g| + eps) plus the decoupled decay.
  OptimizerConfig config;
  config.lr = 0.01;
  config.weight_decay = 0.1;
  Tensor decayed = scalar_tensor(2.0f), exempt = scalar_tensor(2.0f);
  AdamW adamw(config, {decayed, exempt}, {true, false});
  adamw.step({scalar_tensor(-3.0f), scalar_tensor(-3.0f)}, config.lr);
  EXPECT_EQ(adamw.step_count(), 1);
  EXPECT_NEAR(exempt.data<float>()[0], 2.0 + 0.01, 1e-6);
  EXPECT_NEAR(decayed.data<float>()[0], 2.0 * (1 - 0.01 * 0.1) + 0.01, 1e-6);
  EXPECT_NEAR(adamw.exp_avg()[0].data<float>()[0], -0.3, 1e-7);
  EXPECT_NEAR(adamw.exp_avg_sq()[0].data<float>()[0], 0.05 * 9.0, 1e-6);
}

TEST(OptimAdamW, MomentsFollowTheirRecurrences) {
  OptimizerConfig config;
  config.lr = 1e-3;
  config.beta1 = 0.8;
  config.beta2 = 0.9;
  config.weight_decay = 0.0;
  Tensor param = scalar_tensor(1.0f);
  AdamW adamw(config, {param}, {true});
  double m = 0.0, v = 0.0, p = 1.0;
  for (int step = 1; step <= 5; ++step) {
    double g = 0.5 * step - 1.2;
    adamw.step({scalar_tensor(static_cast<float>(g))}, config.lr);
    m = 0.8 * m + 0.2 * g;
    v = 0.9 * v + 0.1 * g * g;
    double m_hat = m / (1 - std::pow(0.8, step)), v_hat = v / (1 - std::pow(0.9, step));
    p -= config.lr * m_hat / (std::sqrt(v_hat) + config.eps);
    EXPECT_NEAR(adamw.exp_avg()[0].data<float>()[0], m, 1e-6) << step;
    EXPECT_NEAR(adamw.exp_avg_sq()[0].data<float>()[0], v, 1e-6) << step;
    EXPECT_NEAR(param.data<float>()[0], p, 1e-6) << step;
  }
}

TEST(OptimAdamW, RejectsMisalignedGrads) {
  OptimizerConfig config;
  AdamW adamw(config, {scalar_tensor(1.0f)}, {true});
  EXPECT_THROW(adamw.step({}, 1e-3), Error);
  EXPECT_THROW(adamw.step({Tensor::zeros({2})}, 1e-3), Error);
}

}  // namespace
}  // namespace forge
