#include <gtest/gtest.h>

#include "optim/optimizer.h"

namespace forge {
namespace {

OptimizerConfig peak(double lr) {
  OptimizerConfig opt;
  opt.lr = lr;
  return opt;
}

LRSchedulerConfig schedule(int64_t warmup, const char* style, int64_t decay_steps, double min_lr) {
  LRSchedulerConfig s;
  s.warmup_steps = warmup;
  s.decay_style = style;
  s.decay_steps = decay_steps;
  s.min_lr = min_lr;
  return s;
}

TEST(OptimSchedule, WarmupEndpoints) {
  OptimizerConfig opt = peak(1.0);
  for (const char* style : {"cosine", "linear", "constant"}) {
    LRSchedulerConfig s = schedule(4, style, 0, 0.0);
    EXPECT_DOUBLE_EQ(lr_at(opt, s, 0, 20), 1.0 / 5.0) << style;
    EXPECT_DOUBLE_EQ(lr_at(opt, s, 3, 20), 4.0 / 5.0) << style;
    EXPECT_DOUBLE_EQ(lr_at(opt, s, 4, 20), 1.0) << style;
  }
}

TEST(OptimSchedule, NoWarmupStartsAtPeak) {
  EXPECT_DOUBLE_EQ(lr_at(peak(3e-4), schedule(0, "cosine", 0, 0.0), 0, 10), 3e-4);
  EXPECT_DOUBLE_EQ(lr_at(peak(3e-4), schedule(0, "linear", 0, 0.0), 0, 10), 3e-4);
}

TEST(OptimSchedule, ZeroPeakIsZeroThroughout) {
  // optimizer.lr 0 is a dry run; linear decay would otherwise divide min_lr by the peak.
  for (const char* style : {"cosine", "linear", "constant"})
    for (int64_t step : {0, 1, 3, 9}) {
      const double lr = lr_at(peak(0.0), schedule(2, style, 0, 0.0), step, 10);
      EXPECT_EQ(lr, 0.0) << style << " step " << step;
    }
}

TEST(OptimSchedule, CosineMidpointAndFloor) {
  OptimizerConfig opt = peak(1.0);
  LRSchedulerConfig s = schedule(2, "cosine", 10, 0.1);
  EXPECT_NEAR(lr_at(opt, s, 2 + 5, 100), 0.55, 1e-15);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 2 + 10, 100), 0.1);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 99, 100), 0.1);
  for (int64_t step = 3; step < 100; ++step) {
    EXPECT_LE(lr_at(opt, s, step, 100), lr_at(opt, s, step - 1, 100)) << step;
    EXPECT_GE(lr_at(opt, s, step, 100), 0.1) << step;
  }
}

TEST(OptimSchedule, LinearDecayAndFloor) {
  OptimizerConfig opt = peak(2.0);
  LRSchedulerConfig s = schedule(0, "linear", 4, 0.4);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 1, 50), 1.6);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 2, 50), 1.2);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 4, 50), 0.4);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 49, 50), 0.4);
}

TEST(OptimSchedule, DecayStepsZeroMeansUntilTrainingEnds) {
  OptimizerConfig opt = peak(1.0);
  LRSchedulerConfig s = schedule(10, "linear", 0, 0.0);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 10 + 45, 100), 0.5);
  EXPECT_GT(lr_at(opt, s, 99, 100), 0.0);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 100, 100), 0.0);
}

TEST(OptimSchedule, ConstantHoldsPeakAndIgnoresMinLr) {
  OptimizerConfig opt = peak(5e-4);
  LRSchedulerConfig s = schedule(3, "constant", 0, 1e-5);
  for (int64_t step = 3; step < 40; ++step) EXPECT_EQ(lr_at(opt, s, step, 40), 5e-4);
}

TEST(OptimSchedule, WarmupLongerThanRunNeverDecays) {
  OptimizerConfig opt = peak(1.0);
  LRSchedulerConfig s = schedule(100, "cosine", 0, 0.0);
  EXPECT_DOUBLE_EQ(lr_at(opt, s, 9, 10), 10.0 / 101.0);
}

}  // namespace
}  // namespace forge
