// The memory economies of FLUX runs. optimizer.master_dtype bf16 (NOTE [bf16 master
// weights] in optim/optimizer.h) on the CPU reference: the run tracks the fp32-master run's
// losses, its checkpoints hold the bf16 weights widened exactly (every value's low 16 bits
// zero), a run resumed from one ends bit for bit where the uninterrupted run does, and the
// configs that cannot take it (a language model, FLUX under FSDP) are refused naming the key.
// activation_checkpoint.recompute_blocks (NOTE [Recomputing some FLUX blocks] in
// model/flux_transformer.h): a run recomputing some blocks has full checkpointing's losses
// bit for bit, and the keys it needs are checked.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

#include "cli/config.h"
#include "expect_error.h"
#include "test_data_temp_dir.h"
#include "train/flux_trainer.h"

namespace forge {
namespace {

ExperimentConfig flux_run(const std::string& run_dir, int64_t steps, const std::string& master_dtype) {
  return load_experiment("", {{"flux.model", "flux-debug"},
                              {"flux.resolution", "64"},
                              {"flux.text_tokens", "8"},
                              {"training.device", "cpu"},
                              {"precision.compute_dtype", "fp32"},
                              {"training.local_batch_size", "2"},
                              {"training.steps", std::to_string(steps)},
                              {"optimizer.lr", "1e-3"},
                              {"optimizer.master_dtype", master_dtype},
                              {"lr_scheduler.warmup_steps", "2"},
                              {"lr_scheduler.decay_style", "constant"},
                              {"eval.interval", "0"},
                              {"logging.run_dir", run_dir},
                              {"checkpoint.enable", "true"},
                              {"checkpoint.interval", "3"}});
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string final_state(const std::string& run_dir, int64_t step) {
  return file_bytes(run_dir + "/checkpoints/step-" + std::to_string(step) + "/rank-0.bin");
}

TEST(FluxBf16Master, TracksFp32MastersAndResumesBitForBit) {
  TempDir tmp;
  const FluxTrainResult fp32 = FluxTrainer(flux_run(tmp.file("fp32"), 6, "fp32")).run(false);
  const FluxTrainResult bf16 = FluxTrainer(flux_run(tmp.file("bf16"), 6, "bf16")).run(false);
  ASSERT_EQ(bf16.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_TRUE(std::isfinite(bf16.losses[i]));
    // The weights differ by bf16 rounding (2^-9 relative) from the start: the losses by far less than 1%.
    EXPECT_NEAR(bf16.losses[i], fp32.losses[i], 1e-2 * fp32.losses[i]) << "step " << i + 1;
  }
  // The checkpoint's first third is the weights: bf16 values widened, so no low bits.
  const std::string state = final_state(tmp.file("bf16"), 6);
  ASSERT_EQ(state.size() % 12, 0u);
  const size_t weights = state.size() / 3;
  size_t low_bits = 0;
  for (size_t i = 0; i < weights; i += 4) {
    uint32_t u = 0;
    std::memcpy(&u, state.data() + i, 4);
    low_bits += (u & 0xFFFFu) != 0;
  }
  EXPECT_EQ(low_bits, 0u);
  EXPECT_NE(state, final_state(tmp.file("fp32"), 6));

  const std::string resumed = tmp.file("resumed");
  FluxTrainer(flux_run(resumed, 3, "bf16")).run(false);
  const FluxTrainResult rest = FluxTrainer(flux_run(resumed, 6, "bf16")).run(false);
  ASSERT_EQ(rest.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(rest.losses[i], bf16.losses[i + 3]) << "step " << i + 4;
  EXPECT_TRUE(final_state(resumed, 6) == state);
}

TEST(FluxBf16Master, RefusedWhereItIsNotBuilt) {
  expect_error([] { load_experiment("", {{"optimizer.master_dtype", "bf16"}}); },
               {"optimizer.master_dtype", "language model", "FLUX"});
  expect_error([] { load_experiment("", {{"optimizer.master_dtype", "fp16"}}); }, {"optimizer.master_dtype", "fp16"});
  for (const char* key : {"optimizer.master_dtype", "optimizer.state_dtype"})
    expect_error(
        [&] {
          load_experiment("", {{"flux.model", "flux-debug"},
                               {"flux.resolution", "64"},
                               {"training.device", "cuda"},
                               {"precision.compute_dtype", "bf16"},
                               {"parallelism.data_parallel_shard_degree", "2"},
                               {key, "bf16"}});
        },
        {key, "FSDP", "one device"});
}

TEST(FluxRecomputeBlocks, SomeBlocksRecomputedGiveFullCheckpointingsLosses) {
  TempDir tmp;
  auto run = [&](const std::string& name, const std::string& recompute) {
    ExperimentConfig c = flux_run(tmp.file(name), 3, "fp32");
    c.activation_checkpoint.mode = "full";
    c.activation_checkpoint.recompute_blocks = std::stoll(recompute);
    return FluxTrainer(c).run(false).losses;
  };
  const std::vector<double> full = run("full", "-1");
  EXPECT_EQ(run("three", "3"), full);
  EXPECT_EQ(run("none", "0"), full);
}

TEST(FluxRecomputeBlocks, ConfigRules) {
  expect_error([] { load_experiment("", {{"activation_checkpoint.recompute_blocks", "2"}}); },
               {"activation_checkpoint.recompute_blocks", "language model"});
  const ConfigOverrides flux = {{"flux.model", "flux-debug"}, {"flux.resolution", "64"}, {"eval.interval", "0"}};
  auto with = [&](ConfigOverrides extra) {
    ConfigOverrides all = flux;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  expect_error([&] { load_experiment("", with({{"activation_checkpoint.recompute_blocks", "2"}})); },
               {"activation_checkpoint.recompute_blocks", "activation_checkpoint.mode", "full"});
  expect_error(
      [&] {
        load_experiment("", with({{"activation_checkpoint.mode", "full"},
                                  {"activation_checkpoint.recompute_blocks", "5"}}));
      },
      {"activation_checkpoint.recompute_blocks", "4 blocks"});
  expect_error([&] { load_experiment("", with({{"activation_checkpoint.recompute_blocks", "-2"}})); },
               {"activation_checkpoint.recompute_blocks", "-2"});
  const ExperimentConfig ok = load_experiment(
      "", with({{"activation_checkpoint.mode", "full"}, {"activation_checkpoint.recompute_blocks", "4"}}));
  EXPECT_EQ(ok.activation_checkpoint.recompute_blocks, 4);
}

}  // namespace
}  // namespace forge
