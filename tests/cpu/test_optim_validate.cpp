#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>

#include "optim/config_rules.h"

namespace forge {
namespace {

std::string validation_error(const std::function<void(OptimizerConfig&, LRSchedulerConfig&)>& edit,
                             int64_t total_steps = 100) {
  OptimizerConfig opt;
  LRSchedulerConfig sched;
  edit(opt, sched);
  try {
    validate(opt, sched, total_steps);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(OptimValidate, DefaultsPass) {
  EXPECT_EQ(validation_error([](OptimizerConfig&, LRSchedulerConfig&) {}), "");
}

TEST(OptimValidate, OptimizerMessagesNameTheKey) {
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.name = "sgd"; }), "optimizer.name must be adamw, got 'sgd'");
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.lr = -1; }), "optimizer.lr must be >= 0, got -1");
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.lr = std::nan(""); }), "optimizer.lr must be >= 0, got nan");
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.lr = 0; }), "");  // a dry run
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.beta1 = 1.0; }), "optimizer.beta1 must be in [0, 1), got 1");
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.beta2 = -0.5; }), "optimizer.beta2 must be in [0, 1), got -0.5");
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.eps = 0; }), "optimizer.eps must be > 0, got 0");
  EXPECT_EQ(validation_error([](auto& o, auto&) { o.weight_decay = -0.1; }),
            "optimizer.weight_decay must be >= 0, got -0.1");
}

TEST(OptimValidate, SchedulerMessagesNameTheKey) {
  EXPECT_EQ(validation_error([](auto&, auto& s) { s.warmup_steps = -1; }),
            "lr_scheduler.warmup_steps must be >= 0, got -1");
  EXPECT_EQ(validation_error([](auto&, auto& s) { s.decay_style = "cosin"; }),
            "lr_scheduler.decay_style must be one of cosine, linear, constant, got 'cosin'");
  EXPECT_EQ(validation_error([](auto&, auto& s) { s.decay_steps = -3; }),
            "lr_scheduler.decay_steps must be >= 0, got -3");
  EXPECT_EQ(validation_error([](auto&, auto& s) { s.min_lr = -1e-5; }),
            "lr_scheduler.min_lr must be >= 0, got -1e-05");
  EXPECT_EQ(validation_error([](auto& o, auto& s) {
              o.lr = 1e-4;
              s.min_lr = 3e-4;
            }),
            "lr_scheduler.min_lr (0.0003) must not exceed optimizer.lr (0.0001)");
  EXPECT_EQ(validation_error([](auto&, auto&) {}, 0), "training.steps must be >= 1, got 0");
}

TEST(OptimValidate, EdgeValuesPass) {
  EXPECT_EQ(validation_error([](auto& o, auto& s) {
              o.beta1 = 0.0;
              o.weight_decay = 0.0;
              s.min_lr = o.lr;
              s.decay_style = "constant";
            }),
            "");
}

}  // namespace
}  // namespace forge
