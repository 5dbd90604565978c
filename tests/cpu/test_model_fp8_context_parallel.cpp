// FP8 projections under context parallelism in the model (NOTE [FP8 under context and
// pipeline parallelism] in train/trainer_fp8.cpp): C ranks (threads over the CPU process
// group), each with its own Fp8Projections over the same weights and its two chunks of every
// sequence, against one rank's FP8 step over the whole micro-batch.
//  - delayed, with the scales agreed (every rank restored from one rank's state after a
//    first step, as a checkpoint or the step-end reduction leaves them): every rank
//    quantizes its rows with the whole sequence's scales, so the loss and the gradients
//    summed over the ranks are one rank's within fp32 reordering (measured 7e-8 and 3.2e-7
//    relative; bounds 1e-6 and 1e-5); the ranks' step amaxes, max-reduced as the trainer
//    does, are one rank's (the weights' exactly, x's and dy's within 1e-5);
//  - tensorwise (current scaling per rank): each rank scales x and dy by its chunks' amax,
//    so the codes differ from one rank's and the step follows it within FP8 rounding: the
//    loss within 8.8e-5 (bound 1e-3), a gradient's relative L2 gap up to 17% (bound 0.3),
//    E5M2's 2 mantissa bits rounding dy otherwise (one FP8 micro-batch's gradients are 12%
//    from fp32's, README "FP8 training").
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/context_parallel_group.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/parameters.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;

struct Fp8Run {
  double loss_gap = 0;      // |rank 0's loss - one rank's| / one rank's
  double gradient_gap = 0;  // the largest relative L2 gap of a gradient summed over the ranks
  Tensor stats;             // the ranks' statistics, max-reduced
};

// One step of `cp` context-parallel ranks against `one` (whose FP8 state it starts from),
// which runs the same step over the whole micro-batch.
Fp8Run fp8_step_against_one(const ModelConfig& m, const Fp8Settings& settings, int cp, Fp8Projections& one_fp8,
                            const FlatParameters& params) {
  const int64_t micro = 2, seq = 32;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 31);
  const Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 32);
  const float scale = 1.0f / static_cast<float>(micro * seq);
  FlatParameters reference_grads(m);
  reference_grads.zero();
  one_fp8.set_base(const_cast<FlatParameters&>(params), reference_grads);
  DecoderLM one(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None);
  const LossSum reference = one.forward_backward(tokens, targets, one_fp8, one_fp8, scale);

  std::vector<std::unique_ptr<FlatParameters>> grads;
  std::vector<std::unique_ptr<Fp8Projections>> fp8;
  for (int r = 0; r < cp; ++r) {
    grads.push_back(std::make_unique<FlatParameters>(m));
    grads.back()->zero();
    fp8.push_back(std::make_unique<Fp8Projections>(m, settings, Device::CPU, micro * seq / cp));
    fp8.back()->set_base(const_cast<FlatParameters&>(params), *grads.back());
    if (settings.recipe == Fp8Recipe::Delayed) fp8.back()->restore_delayed_state(one_fp8.delayed_state());
  }
  std::vector<LossSum> losses(static_cast<size_t>(cp));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(cp, [&](int r) {
    auto group = create_process_group(testing::env_of(r, cp, port), options);
    GroupContextParallel context_parallel(*group);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr,
                    &context_parallel);
    const size_t k = static_cast<size_t>(r);
    losses[k] = model.forward_backward(tokens, targets, *fp8[k], *fp8[k], scale);
    group->barrier();
  });
  for (const std::string& e : errors) EXPECT_EQ(e, "");

  Fp8Run run;
  for (int r = 0; r < cp; ++r) {
    EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, reference.tokens);
    EXPECT_EQ(losses[static_cast<size_t>(r)].sum, losses[0].sum) << "every rank reports the micro-batch's loss";
  }
  run.loss_gap = std::abs(losses[0].sum - reference.sum) / std::abs(reference.sum);
  for (size_t s = 0; s < params.specs().size(); ++s) {
    Tensor sum = Tensor::zeros(params.tensors()[s].shape());
    for (int r = 0; r < cp; ++r) {
      const Tensor& g = grads[static_cast<size_t>(r)]->tensors()[s];
      for (int64_t i = 0; i < g.numel(); ++i) sum.data<float>()[i] += g.data<float>()[i];
    }
    run.gradient_gap = std::max(run.gradient_gap, relative_gap(sum, reference_grads.tensors()[s]));
  }
  run.stats = fp8[0]->statistics().to(Device::CPU);
  for (int r = 1; r < cp; ++r) {
    const Tensor theirs = fp8[static_cast<size_t>(r)]->statistics();
    for (int64_t i = 0; i < theirs.numel(); ++i)
      run.stats.data<float>()[i] = std::max(run.stats.data<float>()[i], theirs.data<float>()[i]);
  }
  return run;
}

Fp8Settings settings_of(Fp8Recipe recipe) {
  Fp8Settings s;
  s.recipe = recipe;
  s.amax_history_length = 4;
  return s;
}

TEST(ModelFp8ContextParallel, DelayedScalesAgreedGiveOneRanksStep) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}}).model;
  FlatParameters params(m);
  params.initialize(7);
  for (const int cp : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} context-parallel ranks", cp));
    const Fp8Settings settings = settings_of(Fp8Recipe::Delayed);
    Fp8Projections one_fp8(m, settings, Device::CPU, 64);
    {  // a first step (current scales) gives the histories and scales the ranks start from
      FlatParameters g(m);
      g.zero();
      one_fp8.set_base(params, g);
      DecoderLM one(m, 2, 32, Device::CPU, DType::F32, ActivationCheckpoint::None);
      one.forward_backward(testing::random_tokens(2, 32, m.vocab_size, 41),
                           testing::random_tokens(2, 32, m.vocab_size, 42), one_fp8, one_fp8, 1.0f / 64);
      one_fp8.end_step(true);
      ASSERT_TRUE(one_fp8.delayed_active());
    }
    const Fp8Run run = fp8_step_against_one(m, settings, cp, one_fp8, params);
    EXPECT_LT(run.loss_gap, 1e-6);
    EXPECT_LT(run.gradient_gap, 1e-5);
    // The step's amaxes, max over the ranks, are the whole sequence's.
    const Tensor want = one_fp8.statistics();
    const int64_t projections = fp8_projection_count(m, settings);
    for (int64_t p = 0; p < projections; ++p)
      for (int r = 0; r < cpu::kFp8Roles; ++r) {
        const auto role = static_cast<cpu::Fp8Role>(r);
        const float got = run.stats.data<float>()[cpu::fp8_seen_offset(p, role)];
        const float expected = want.data<float>()[cpu::fp8_seen_offset(p, role)];
        EXPECT_GT(expected, 0.0f);
        if (role == cpu::Fp8Role::W) EXPECT_EQ(got, expected) << "projection " << p;
        else EXPECT_NEAR(got, expected, 1e-5 * expected) << "projection " << p << " " << cpu::fp8_role_name(role);
        EXPECT_EQ(run.stats.data<float>()[cpu::fp8_scale_offset(p, role)],
                  want.data<float>()[cpu::fp8_scale_offset(p, role)]);
      }
  }
}

TEST(ModelFp8ContextParallel, TensorwiseFollowsOneRank) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}}).model;
  FlatParameters params(m);
  params.initialize(8);
  for (const int cp : {2, 4}) {
    SCOPED_TRACE(fmt::format("{} context-parallel ranks", cp));
    const Fp8Settings settings = settings_of(Fp8Recipe::Tensorwise);
    Fp8Projections one_fp8(m, settings, Device::CPU, 64);
    const Fp8Run run = fp8_step_against_one(m, settings, cp, one_fp8, params);
    EXPECT_LT(run.loss_gap, 1e-3);
    EXPECT_LT(run.gradient_gap, 0.3);
  }
}

}  // namespace
}  // namespace forge
