#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "expect_error.h"
#include "train/flow_timesteps.h"

namespace forge {
namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

FlowTimestepSampling settings(const std::string& weighting, const std::string& shift) {
  FlowTimestepSampling s;
  s.weighting = weighting;
  s.shift = shift;
  return s;
}

TEST(FlowTimesteps, WeightingsMapTheirDraws) {
  FlowTimestepSampling s = settings("logit_normal", "none");
  s.logit_mean = 0.4;
  s.logit_std = 1.5;
  for (double z : {-3.0, -0.5, 0.0, 1.25, 4.0}) EXPECT_DOUBLE_EQ(flow_timestep(s, z, 1024), sigmoid(0.4 + 1.5 * z));
  const FlowTimestepSampling u = settings("uniform", "none");
  for (double draw : {1e-6, 0.25, 0.5, 0.999}) EXPECT_EQ(flow_timestep(u, draw, 1024), draw);
}

TEST(FlowTimesteps, ShiftsFollowTheirFormulas) {
  FlowTimestepSampling fixed = settings("uniform", "fixed");
  fixed.shift_value = 3.0;
  for (double t0 : {0.01, 0.2, 0.5, 0.8, 0.99}) {
    EXPECT_DOUBLE_EQ(flow_timestep(fixed, t0, 1), 3.0 * t0 / (1.0 + 2.0 * t0));
    EXPECT_GT(flow_timestep(fixed, t0, 1), t0);  // s > 1 moves t towards noise
  }
  FlowTimestepSampling resolution = settings("uniform", "resolution");
  // mu runs linearly from base_shift at base_seq_len to max_shift at max_seq_len, and on.
  EXPECT_DOUBLE_EQ(flow_shift_mu(resolution, 256), 0.5);
  EXPECT_DOUBLE_EQ(flow_shift_mu(resolution, 4096), 1.15);
  EXPECT_NEAR(flow_shift_mu(resolution, 1024), 0.5 + 0.65 * 768.0 / 3840.0, 1e-15);
  EXPECT_NEAR(flow_shift_mu(resolution, 8192), 0.5 + 0.65 * 7936.0 / 3840.0, 1e-15);
  for (int64_t seq_len : {64, 256, 1024, 4096, 6000}) {
    const double mu = flow_shift_mu(resolution, seq_len);
    fixed.shift_value = std::exp(mu);
    for (double t0 : {0.01, 0.2, 0.5, 0.8, 0.99}) {
      const double t = flow_timestep(resolution, t0, seq_len);
      EXPECT_NEAR(t, std::exp(mu) / (std::exp(mu) + (1.0 / t0 - 1.0)), 1e-15);
      EXPECT_NEAR(t, flow_timestep(fixed, t0, seq_len), 1e-15) << seq_len << " " << t0;  // s = e^mu
    }
  }
  FlowTimestepSampling none = settings("uniform", "none");
  fixed.shift_value = 1.0;
  for (double t0 : {0.01, 0.5, 0.99}) EXPECT_DOUBLE_EQ(flow_timestep(fixed, t0, 1), flow_timestep(none, t0, 1));
}

TEST(FlowTimesteps, LogitNormalDrawsCentreOnTheMean) {
  FlowTimestepSampling s = settings("logit_normal", "none");
  s.logit_mean = 0.5;
  s.logit_std = 1.2;
  std::vector<float> t = sample_flow_timesteps(s, 11, 3, 0, 40001, 4096);
  std::vector<double> logits;
  for (float v : t) {
    ASSERT_GT(v, 0.0f);
    ASSERT_LT(v, 1.0f);
    logits.push_back(std::log(v / (1.0 - v)));
  }
  std::nth_element(t.begin(), t.begin() + 20000, t.end());
  EXPECT_NEAR(t[20000], sigmoid(0.5), 0.01);
  double mean = 0, var = 0;
  for (double l : logits) mean += l;
  mean /= static_cast<double>(logits.size());
  for (double l : logits) var += (l - mean) * (l - mean);
  EXPECT_NEAR(mean, 0.5, 0.03);
  EXPECT_NEAR(std::sqrt(var / static_cast<double>(logits.size())), 1.2, 0.03);
}

TEST(FlowTimesteps, UniformDrawsAverageOneHalf) {
  std::vector<float> t = sample_flow_timesteps(settings("uniform", "none"), 5, 0, 2, 100000, 1);
  double sum = 0;
  for (float v : t) {
    ASSERT_GT(v, 0.0f);
    ASSERT_LT(v, 1.0f);
    sum += v;
  }
  EXPECT_NEAR(sum / static_cast<double>(t.size()), 0.5, 5e-3);
}

TEST(FlowTimesteps, DrawsDependOnlyOnSeedStepAndMicroBatch) {
  const FlowTimestepSampling s;
  const std::vector<float> a = sample_flow_timesteps(s, 9, 100, 1, 16, 4096);
  EXPECT_EQ(a, sample_flow_timesteps(s, 9, 100, 1, 16, 4096));
  const std::vector<float> prefix = sample_flow_timesteps(s, 9, 100, 1, 8, 4096);
  EXPECT_TRUE(std::equal(prefix.begin(), prefix.end(), a.begin()));  // sample j is the same whatever the batch
  EXPECT_NE(a, sample_flow_timesteps(s, 10, 100, 1, 16, 4096));
  EXPECT_NE(a, sample_flow_timesteps(s, 9, 101, 1, 16, 4096));
  EXPECT_NE(a, sample_flow_timesteps(s, 9, 100, 0, 16, 4096));
  EXPECT_NE(a, sample_flow_timesteps(s, 9, 100 + (int64_t{1} << 32), 1, 16, 4096));
  // The resolution shift moves larger images' times up, draw for draw.
  const std::vector<float> small = sample_flow_timesteps(s, 9, 100, 1, 16, 256);
  for (size_t j = 0; j < a.size(); ++j) EXPECT_GT(a[j], small[j]);
}

std::string validation_error(const std::function<void(FlowTimestepSampling&)>& edit) {
  FlowTimestepSampling s;
  edit(s);
  return error_of([&] { s.validate(); });
}

TEST(FlowTimesteps, ValidateNamesTheBadKey) {
  EXPECT_EQ(validation_error([](auto&) {}), "");
  EXPECT_EQ(validation_error([](auto& s) { s.weighting = "mode"; }),
            "flux.timestep_sampling must be one of logit_normal, uniform, got 'mode'");
  EXPECT_EQ(validation_error([](auto& s) { s.logit_std = 0; }), "flux.logit_std must be > 0, got 0");
  EXPECT_EQ(validation_error([](auto& s) { s.logit_mean = std::nan(""); }),
            "flux.logit_mean must be a finite number, got nan");
  EXPECT_EQ(validation_error([](auto& s) { s.shift = "linear"; }),
            "flux.timestep_shift must be one of resolution, fixed, none, got 'linear'");
  EXPECT_EQ(validation_error([](auto& s) { s.shift_value = -1; }), "flux.shift must be > 0, got -1");
  EXPECT_EQ(validation_error([](auto& s) { s.max_shift = INFINITY; }),
            "flux.max_shift must be a finite number, got inf");
  EXPECT_EQ(validation_error([](auto& s) { s.base_seq_len = 0; }), "flux.base_seq_len must be >= 1, got 0");
  EXPECT_EQ(validation_error([](auto& s) { s.max_seq_len = 256; }),
            "flux.max_seq_len (256) must be above flux.base_seq_len (256)");
}

TEST(FlowTimesteps, RejectsDrawsAndCountersOutOfRange) {
  const FlowTimestepSampling u = settings("uniform", "none");
  expect_error([&] { flow_timestep(u, 1.5, 1); }, {"uniform draw 1.5"});
  expect_error([&] { flow_shift_mu(u, 0); }, {"0 tokens"});
  expect_error([&] { sample_flow_timesteps(u, 1, -1, 0, 4, 1); }, {"step -1"});
  expect_error([&] { sample_flow_timesteps(u, 1, 0, int64_t{1} << 32, 4, 1); }, {"micro-batch 4294967296"});
}

}  // namespace
}  // namespace forge
