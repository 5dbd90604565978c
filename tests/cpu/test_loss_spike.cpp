// NOTE [Loss spikes] (train/loss_spike.h): the detector's window, warm-up and factor, a spike
// kept out of the mean, its window in checkpoint metadata (and metadata without it), the
// config keys' validation, and FORGE_TEST_SCALE_LOSS's parsing.
#include <gtest/gtest.h>

#include <cstdlib>
#include <nlohmann/json.hpp>
#include <vector>

#include "ckpt/checkpoint_metadata.h"
#include "cli/config.h"
#include "cli/config_defaults.h"
#include "expect_error.h"
#include "train/loss_spike.h"

namespace forge {
namespace {

TEST(LossSpikeDetector, OffNeverReportsAndKeepsNothing) {
  LossSpikeDetector d(0, 100);
  EXPECT_FALSE(d.enabled());
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(d.observe(i == 15 ? 1e6 : 1.0).spike);
  EXPECT_TRUE(d.recent().empty());
}

TEST(LossSpikeDetector, WarmUpIsTenLossesOrTheWholeSmallerWindow) {
  LossSpikeDetector d(2, 100);
  for (int i = 0; i < 10; ++i) {
    const auto v = d.observe(i == 9 ? 100.0 : 1.0);  // not judged: only 9 losses are known
    EXPECT_FALSE(v.spike);
    EXPECT_EQ(v.count, 0);
  }
  EXPECT_EQ(d.recent().size(), 10u);
  const auto v = d.observe(100.0);  // 10 known: mean (9 + 100) / 10 = 10.9, 100 > 21.8
  EXPECT_TRUE(v.spike);
  EXPECT_DOUBLE_EQ(v.mean, 10.9);
  EXPECT_EQ(v.count, 10);

  LossSpikeDetector small(2, 3);
  EXPECT_FALSE(small.observe(1).spike);
  EXPECT_FALSE(small.observe(1).spike);
  EXPECT_FALSE(small.observe(1).spike);
  EXPECT_TRUE(small.observe(2.5).spike);
}

TEST(LossSpikeDetector, FactorIsAStrictBound) {
  LossSpikeDetector d(1.5, 2);
  d.observe(2);
  d.observe(2);
  EXPECT_FALSE(d.observe(3).spike);  // 3 == 1.5 × 2: not above
  EXPECT_EQ(d.recent(), (std::vector<double>{2, 3}));
  EXPECT_TRUE(d.observe(3.76).spike);  // mean 2.5: bound 3.75
}

TEST(LossSpikeDetector, WindowSlidesAndSpikesStayOutOfTheMean) {
  LossSpikeDetector d(2, 3);
  for (double l : {4.0, 1.0, 1.0, 1.0}) EXPECT_FALSE(d.observe(l).spike);
  EXPECT_EQ(d.recent(), (std::vector<double>{1, 1, 1}));  // the oldest left the window
  for (int i = 0; i < 5; ++i) {
    const auto v = d.observe(5.0);  // a loss that stays up is a spike every time: it never enters
    EXPECT_TRUE(v.spike);
    EXPECT_EQ(v.mean, 1.0);
  }
  EXPECT_EQ(d.recent(), (std::vector<double>{1, 1, 1}));
  EXPECT_FALSE(d.observe(1.9).spike);
  EXPECT_EQ(d.recent(), (std::vector<double>{1, 1, 1.9}));
}

TEST(LossSpikeDetector, RestoredDetectorDecidesAsTheOriginal) {
  const std::vector<double> losses{3.1, 3.0, 2.9, 2.95, 2.8, 9.0, 2.7, 2.75, 2.6, 2.65, 8.0, 2.5, 6.0, 2.4};
  LossSpikeDetector whole(2, 4);
  std::vector<bool> expected;
  for (double l : losses) expected.push_back(whole.observe(l).spike);
  for (size_t cut = 0; cut <= losses.size(); ++cut) {
    LossSpikeDetector first(2, 4);
    for (size_t i = 0; i < cut; ++i) first.observe(losses[i]);
    LossSpikeDetector resumed(2, 4);
    resumed.restore(first.recent());
    for (size_t i = cut; i < losses.size(); ++i) EXPECT_EQ(resumed.observe(losses[i]).spike, expected[i]) << cut;
    EXPECT_EQ(resumed.recent(), whole.recent());
  }
  LossSpikeDetector shrunk(2, 2);  // a smaller window keeps the newest
  shrunk.restore({1, 2, 3});
  EXPECT_EQ(shrunk.recent(), (std::vector<double>{2, 3}));
}

nlohmann::json metadata_with(const std::vector<double>& losses) {
  CheckpointMetadata md;
  md.model = debug_tiny_model();
  md.flat_numel = 8;
  md.shards = {{0, 8}};
  md.tensors = {{"w", FlatState::Param, {2, 4}, 0, {{0, 0, 0, 32, 0}}}};
  md.training.recent_losses = losses;
  return nlohmann::json::parse(metadata_to_json(md));
}

TEST(LossSpikeCheckpoint, WindowRoundTripsExactly) {
  const std::vector<double> losses{0.1, 1.0 / 3.0, 2.718281828459045, 5e-300};
  EXPECT_EQ(metadata_from_json(metadata_with(losses).dump(1), "m.json").training.recent_losses, losses);
}

TEST(LossSpikeCheckpoint, MetadataWithoutTheWindowLoadsEmpty) {
  nlohmann::json md = metadata_with({1.0, 2.0});
  md.erase("loss_spike");
  EXPECT_TRUE(metadata_from_json(md.dump(), "m.json").training.recent_losses.empty());
}

TEST(LossSpikeCheckpoint, BadWindowIsNamed) {
  nlohmann::json md = metadata_with({1.0, 2.0});
  md["loss_spike"]["recent_losses"][1] = "x";
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); },
               {"ck/metadata.json", "loss_spike.recent_losses[1]", "finite non-negative number"});
  md["loss_spike"]["recent_losses"][1] = -1.0;
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); }, {"loss_spike.recent_losses[1]"});
  md["loss_spike"] = 3;
  expect_error([&] { metadata_from_json(md.dump(), "ck/metadata.json"); }, {"ck/metadata.json", "loss_spike"});
}

TEST(LossSpikeConfig, KeysAreValidatedByName) {
  const ExperimentConfig c = load_experiment("", {{"training.loss_spike_factor", "3"},
                                                  {"training.loss_spike_window", "50"},
                                                  {"training.on_loss_spike", "skip"}});
  EXPECT_EQ(c.training.loss_spike_factor, 3.0);
  EXPECT_EQ(c.training.loss_spike_window, 50);
  EXPECT_EQ(c.training.on_loss_spike, "skip");
  const ExperimentConfig d = load_experiment("", {});
  EXPECT_EQ(d.training.loss_spike_factor, 0.0);
  EXPECT_EQ(d.training.loss_spike_window, 100);
  EXPECT_EQ(d.training.on_loss_spike, "warn");
  expect_error([] { load_experiment("", {{"training.loss_spike_factor", "1"}}); },
               {"training.loss_spike_factor", "above 1"});
  expect_error([] { load_experiment("", {{"training.loss_spike_factor", "-2"}}); }, {"training.loss_spike_factor"});
  expect_error([] { load_experiment("", {{"training.loss_spike_window", "0"}}); }, {"training.loss_spike_window"});
  expect_error([] { load_experiment("", {{"training.on_loss_spike", "ignore"}}); }, {"training.on_loss_spike"});
}

class ScaleLossVariable : public ::testing::Test {
 protected:
  void TearDown() override { unsetenv("FORGE_TEST_SCALE_LOSS"); }
  std::vector<LossScaling> parse(const char* value) {
    setenv("FORGE_TEST_SCALE_LOSS", value, 1);
    return loss_scalings_from_env();
  }
};

TEST_F(ScaleLossVariable, ParsesAndNamesTheVariable) {
  EXPECT_TRUE(parse("").empty());
  const auto s = parse("7:2.5");
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].step, 7);
  EXPECT_EQ(s[0].factor, 2.5);
  const auto two = parse("3:4,12:0.5");
  ASSERT_EQ(two.size(), 2u);
  EXPECT_EQ(two[1].step, 12);
  EXPECT_EQ(two[1].factor, 0.5);
  for (const char* bad : {"7", "x:2", "0:2", "3:-1", "3:0", "3:2x", "3:inf", "3:2,", ",3:2"})
    expect_error([&] { parse(bad); }, {"FORGE_TEST_SCALE_LOSS", "STEP:FACTOR"});
}

}  // namespace
}  // namespace forge
