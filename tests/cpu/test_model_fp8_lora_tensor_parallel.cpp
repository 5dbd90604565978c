// LoRA with its frozen base's GEMMs in FP8 under tensor parallelism (NOTE [FP8 under tensor
// parallelism] in model/fp8_projections.h, NOTE [FP8 frozen base]): T ranks (threads of this
// process over the CPU process group), each with its base shards under a frozen
// Fp8Projections given the group and its LoraAdapters over them (the split matrices'
// adapter shards), against one rank's LoRA FP8 step of the whole model. Every amax of a
// sharded tensor is max-reduced over the group before its scale, so each rank quantizes
// with one rank's scales and the loss and adapter gradients (spread and summed over the
// ranks, as the trainer's all-reduce) are one rank's within fp32 reordering; the step's
// amaxes max-reduced over the group are one rank's (the frozen weights' bit for bit), and
// a delayed run's histories and scales are the same on every rank. Tensorwise and delayed
// (a first step sets the scales), 2 and 4 ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>

#include "cli/config.h"
#include "distributed/tensor_parallel_group.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model/parameters.h"
#include "lora_testing.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;
using testing::trained_adapters;

void expect_fp8_lora_ranks_match_one(const std::string& model, int t, Fp8Recipe recipe, ActivationCheckpoint mode) {
  const bool delayed = recipe == Fp8Recipe::Delayed;
  SCOPED_TRACE(fmt::format("LoRA FP8 {} on {} ({} tensor-parallel ranks, checkpointing {})",
                           delayed ? "delayed" : "tensorwise", model, t, static_cast<int>(mode)));
  const ModelConfig m = load_experiment("", {{"model.name", model}}).model;
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8.0;
  lora.target_modules = "all-linear";
  const int64_t micro = 2, seq = 16;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 21);
  Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 22);
  targets.data<int32_t>()[5] = -100;
  const float scale = 1.0f / static_cast<float>(micro * seq);
  Fp8Settings settings;
  settings.recipe = recipe;
  settings.frozen = true;
  settings.amax_history_length = 4;
  // A delayed run's second step quantizes with the scales its first step's amaxes gave.
  const int steps = delayed ? 2 : 1;

  FlatParameters base(m);
  base.initialize(5);
  Fp8Projections one_fp8(m, settings, Device::CPU, micro * seq);
  one_fp8.set_base(base);
  auto one = trained_adapters(m, lora, micro * seq, one_fp8);
  DecoderLM whole(m, micro, seq, Device::CPU, DType::F32, mode);
  LossSum reference;
  for (int step = 0; step < steps; ++step) {
    one->discard();
    reference = whole.forward_backward(tokens, targets, *one, *one, scale);
    if (step + 1 < steps) one_fp8.end_step(true);
  }

  std::vector<std::unique_ptr<FlatParameters>> bases;
  std::vector<std::unique_ptr<Fp8Projections>> fp8;
  std::vector<std::unique_ptr<LoraAdapters>> ranks;
  for (int r = 0; r < t; ++r) {
    const TensorParallelShard shard{r, t};
    bases.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, shard));
    bases.back()->initialize(5);
    fp8.push_back(std::make_unique<Fp8Projections>(m, settings, Device::CPU, micro * seq));
    fp8.back()->set_base(*bases.back());
    ranks.push_back(trained_adapters(m, lora, micro * seq, *fp8.back(), shard));
  }
  std::vector<LossSum> losses(static_cast<size_t>(t));
  std::vector<Tensor> statistics(static_cast<size_t>(t));
  std::vector<Fp8DelayedState> states(static_cast<size_t>(t));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(t, [&](int r) {
    auto group = create_process_group(testing::env_of(r, t, port), options);
    GroupTensorParallel tp(*group);
    const size_t k = static_cast<size_t>(r);
    fp8[k]->set_tensor_parallel_group(tp);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, mode, nullptr, &tp);
    for (int step = 0; step < steps; ++step) {
      ranks[k]->discard();
      losses[k] = model.forward_backward(tokens, targets, *ranks[k], *ranks[k], scale);
      tp.all_reduce_max(fp8[k]->statistics());  // as the trainer's step end
      if (step + 1 < steps) fp8[k]->end_step(true);
    }
    ranks[k]->spread_shard_gradients();
    statistics[k] = fp8[k]->statistics().clone();
    states[k] = fp8[k]->delayed_state();
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  double loss_gap = 0.0, gradient_gap = 0.0;
  for (int r = 0; r < t; ++r) {
    EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, reference.tokens);
    const double gap = std::abs(losses[static_cast<size_t>(r)].sum - reference.sum) / std::abs(reference.sum);
    loss_gap = std::max(loss_gap, gap);
    EXPECT_LT(gap, 1e-5) << "rank " << r;
  }
  const std::vector<std::string> names = one->master_names();
  for (size_t i = 0; i < one->gradients().size(); ++i) {
    const Tensor& expected = one->gradients()[i];
    Tensor sum = Tensor::zeros(expected.shape());
    for (int r = 0; r < t; ++r) {
      const Tensor& g = ranks[static_cast<size_t>(r)]->gradients()[i];
      for (int64_t j = 0; j < g.numel(); ++j) sum.data<float>()[j] += g.data<float>()[j];
    }
    const double gap = relative_gap(sum, expected);
    gradient_gap = std::max(gradient_gap, gap);
    EXPECT_LT(gap, 2e-5) << names[i] << "'s gradient summed over the ranks";
  }
  std::printf("LoRA FP8 %s on %d tensor-parallel ranks: loss gap %.3g, largest adapter gradient gap %.3g\n",
              delayed ? "delayed" : "tensorwise", t, loss_gap, gradient_gap);
  const Tensor& want = one_fp8.statistics();
  for (int64_t p = 0; p < fp8_projection_count(m, settings); ++p)
    for (int role_index = 0; role_index < cpu::kFp8Roles; ++role_index) {
      const auto role = static_cast<cpu::Fp8Role>(role_index);
      const float expected = want.data<float>()[cpu::fp8_seen_offset(p, role)];
      const float got = statistics[0].data<float>()[cpu::fp8_seen_offset(p, role)];
      const float scale_got = statistics[0].data<float>()[cpu::fp8_scale_offset(p, role)];
      const float scale_want = want.data<float>()[cpu::fp8_scale_offset(p, role)];
      for (int r = 1; r < t; ++r)
        EXPECT_EQ(statistics[static_cast<size_t>(r)].data<float>()[cpu::fp8_seen_offset(p, role)], got);
      EXPECT_GT(expected, 0.0f) << "projection " << p << " " << cpu::fp8_role_name(role);
      if (role == cpu::Fp8Role::W) {  // the frozen shards' maximum is the whole weight's
        EXPECT_EQ(got, expected) << "projection " << p;
        EXPECT_EQ(scale_got, scale_want) << "projection " << p;
      } else {
        EXPECT_NEAR(got, expected, 1e-5 * expected) << "projection " << p << " " << cpu::fp8_role_name(role);
        EXPECT_NEAR(scale_got, scale_want, 1e-5 * scale_want) << "projection " << p << " " << cpu::fp8_role_name(role);
      }
    }
  for (int r = 1; r < t; ++r) {
    EXPECT_EQ(states[static_cast<size_t>(r)].histories, states[0].histories);
    EXPECT_EQ(states[static_cast<size_t>(r)].scales, states[0].scales);
  }
}

TEST(ModelFp8LoraTensorParallel, RanksMatchOneFp8LoraRank) {
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    expect_fp8_lora_ranks_match_one("debug-tiny", 2, recipe, ActivationCheckpoint::None);
    expect_fp8_lora_ranks_match_one("debug-tiny", 2, recipe, ActivationCheckpoint::Selective);
    expect_fp8_lora_ranks_match_one("debug-tiny-mha", 4, recipe, ActivationCheckpoint::Full);
  }
}

}  // namespace
}  // namespace forge
