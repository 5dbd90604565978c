// precision.fp8_weight_gradient false on the CPU reference (NOTE [FP8 weight gradient switch]
// in ops/fp8_linear.h): the op's input gradient is bitwise the FP8 one and its weight
// gradient bitwise the compute dtype's matmul (written over and added to), with the same
// statistics; training a dense model is bitwise the all-FP8 run whose gradient descriptors
// alone are stripped of their FP8 settings (tensorwise and delayed, with the FP8 head too),
// the delayed states equal; on a Mixture-of-Experts model the input gradients, and so every
// gradient but the FP8 matrices' own, are bitwise the all-FP8 run's; the scratch and FLOP
// share count no FP8 weight gradient; and the configuration rules.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/config.h"
#include "config_test_support.h"
#include "core/rng.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "ops/fp8_linear.h"
#include "ops/matmul.h"
#include "fp8_sgd_step.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "stripped_fp8_source.h"

namespace forge {
namespace {

ExperimentConfig load(ConfigOverrides overrides) { return load_experiment("", overrides); }

constexpr int64_t kBatch = 4, kSeq = 16;

// Fresh statistics blocks for one projection.
Tensor statistics() { return Tensor::zeros({cpu::kFp8ProjectionStats}); }

TEST(Fp8WeightGradient, OpGivesTheFp8InputGradientAndTheComputeDtypeWeightGradient) {
  Rng rng(21);
  const int64_t tokens = 10, in = 24, out = 40;  // tokens no multiple of 16: no FP8 GEMM contracts them
  const Tensor x = testing::random_tensor({tokens, in}, rng), w = testing::random_tensor({out, in}, rng),
               dy = testing::random_tensor({tokens, out}, rng), start = testing::random_tensor({out, in}, rng);
  for (const Fp8Format format : {Fp8Format::E5M2, Fp8Format::E4M3}) {
    SCOPED_TRACE(format == Fp8Format::E5M2 ? "e5m2" : "e4m3");
    Tensor stats = statistics(), ref_stats = statistics();
    Fp8Linear fp8{format, nullptr};
    fp8.stats = stats.data<float>();
    fp8.weight_gradient = false;
    Fp8Linear ref{format, nullptr};
    ref.stats = ref_stats.data<float>();
    for (const bool overwrite : {true, false}) {
      SCOPED_TRACE(overwrite ? "written over" : "added to");
      Tensor dx = Tensor::empty({tokens, in}), dw = start.clone(), want_dx = Tensor::empty({tokens, in}),
             want_dw = start.clone();
      fp8_linear_backward(dx, dw, dy, w, x, fp8, overwrite);
      fp8_linear_backward_input(want_dx, dy, w, ref);
      matmul(want_dw, dy, true, x, false, 1.0f, overwrite ? 0.0f : 1.0f);
      EXPECT_TRUE(testing::bitwise_equal(dx, want_dx));
      EXPECT_TRUE(testing::bitwise_equal(dw, want_dw));
      // dy's and W's statistics as the FP8 input gradient folds them; x was never cast.
      EXPECT_TRUE(testing::bitwise_equal(stats, ref_stats));
      EXPECT_EQ(stats.data<float>()[cpu::fp8_seen_offset(0, cpu::Fp8Role::X)], 0.0f);
      Tensor alone = start.clone();
      fp8_linear_backward_weight(alone, dy, x, fp8, overwrite);
      EXPECT_TRUE(testing::bitwise_equal(alone, want_dw));
    }
  }
}

ModelConfig four_layers(const std::string& name = "debug-tiny") {
  return load({{"model.name", name}, {"model.num_layers", "4"}}).model;
}

Fp8Settings settings(Fp8Recipe recipe, bool weight_gradient, bool output_head = false) {
  Fp8Settings s;
  s.recipe = recipe;
  s.amax_history_length = 4;
  s.weight_gradient = weight_gradient;
  s.output_head = output_head;
  return s;
}

double sgd_step(const ModelConfig& m, DecoderLM& model, FlatParameters& params, FlatParameters& grads,
                Fp8Projections& fp8, ParamSource& weights, GradSink& gradients) {
  return testing::fp8_sgd_step(m, model, params, grads, &fp8, weights, gradients, kBatch, kSeq);
}

// The switch is the all-FP8 run with its weight gradients' descriptors stripped: the
// forward and input gradients in FP8 with the same scales, every weight gradient (the FP8
// head's too) the compute dtype's GEMM, over 3 steps, and the delayed histories equal.
TEST(Fp8WeightGradient, TrainingIsTheFp8RunWithItsWeightGradientsStripped) {
  const ModelConfig m = four_layers();
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed})
    for (const bool head : {false, true}) {
      SCOPED_TRACE(fmt::format("{}{}", recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise",
                               head ? ", FP8 head" : ""));
      DecoderLM model(m, kBatch, kSeq);
      FlatParameters params(m), grads(m), ref_params(m), ref_grads(m), fp8_params(m), fp8_grads(m);
      params.initialize(3);
      ref_params.flat().copy_from(params.flat());
      fp8_params.flat().copy_from(params.flat());
      Fp8Projections subject(m, settings(recipe, false, head), Device::CPU, kBatch * kSeq);
      subject.set_base(params, grads);
      Fp8Projections all(m, settings(recipe, true, head), Device::CPU, kBatch * kSeq);
      all.set_base(ref_params, ref_grads);
      testing::StrippedFp8Source stripped(all, testing::strip_all(), false, /*gradients_only=*/true);
      Fp8Projections fp8(m, settings(recipe, true, head), Device::CPU, kBatch * kSeq);
      fp8.set_base(fp8_params, fp8_grads);
      for (int step = 0; step < 3; ++step) {
        const double loss = sgd_step(m, model, params, grads, subject, subject, subject);
        EXPECT_EQ(loss, sgd_step(m, model, ref_params, ref_grads, all, stripped, stripped)) << step;
        EXPECT_TRUE(testing::bitwise_equal(grads.flat(), ref_grads.flat())) << "step " << step;
        // Not the FP8 weight gradients': the switch does something.
        const double fp8_loss = sgd_step(m, model, fp8_params, fp8_grads, fp8, fp8, fp8);
        if (step == 0) EXPECT_EQ(loss, fp8_loss);
        EXPECT_FALSE(testing::bitwise_equal(grads.flat(), fp8_grads.flat())) << "step " << step;
      }
      if (recipe != Fp8Recipe::Delayed) continue;
      const Fp8DelayedState got = subject.delayed_state(), want = all.delayed_state();
      EXPECT_EQ(got.scales, want.scales);
      EXPECT_EQ(got.histories, want.histories);
    }
}

// On a Mixture-of-Experts model (the routed experts' GEMMs expert by expert) one step's input
// gradients are the all-FP8 step's: the loss and every gradient but the FP8 matrices' (the
// embedding, norms, routers and head) bit for bit; the FP8 matrices' own within FP8's
// rounding of the all-FP8 weight gradients.
TEST(Fp8WeightGradient, MoeInputGradientsAreTheAllFp8Ones) {
  for (const std::string name : {"debug-tiny-moe", "debug-tiny-mla"}) {
    SCOPED_TRACE(name);
    const ModelConfig m = four_layers(name);
    DecoderLM model(m, kBatch, kSeq);
    FlatParameters params(m), grads(m), fp8_params(m), fp8_grads(m);
    params.initialize(5);
    fp8_params.flat().copy_from(params.flat());
    Fp8Projections subject(m, settings(Fp8Recipe::Tensorwise, false), Device::CPU, kBatch * kSeq);
    subject.set_base(params, grads);
    Fp8Projections fp8(m, settings(Fp8Recipe::Tensorwise, true), Device::CPU, kBatch * kSeq);
    fp8.set_base(fp8_params, fp8_grads);
    EXPECT_EQ(sgd_step(m, model, params, grads, subject, subject, subject),
              sgd_step(m, model, fp8_params, fp8_grads, fp8, fp8, fp8));
    const Fp8Settings all = settings(Fp8Recipe::Tensorwise, true);
    int64_t matrices = 0;
    for (size_t k = 0; k < grads.specs().size(); ++k) {
      const ParamSpec& spec = grads.specs()[k];
      const std::string& param = spec.name;
      if (!fp8_block_projection(spec, all) && !fp8_expert_stack(spec, all)) {
        EXPECT_TRUE(testing::bitwise_equal(grads.tensors()[k], fp8_grads.tensors()[k])) << param;
        continue;
      }
      ++matrices;
      EXPECT_LT(testing::relative_l2(grads.tensors()[k], fp8_grads.tensors()[k]), 0.2) << param;
    }
    EXPECT_GT(matrices, 0);
  }
}

TEST(Fp8WeightGradient, ScratchAndFlopShareCountNoFp8WeightGradient) {
  const ModelConfig m = four_layers();
  const int64_t tokens = kBatch * kSeq;
  const Fp8Settings with = settings(Fp8Recipe::Tensorwise, true), without = settings(Fp8Recipe::Tensorwise, false);
  EXPECT_EQ(fp8_scratch_bytes(m, with, tokens) - fp8_scratch_bytes(m, without, tokens),
            fp8_workspace_codes(m, with, tokens));
  EXPECT_EQ(fp8_gemm_params(m, with), fp8_gemm_params(m, without));
}

TEST(Fp8WeightGradient, ConfigRules) {
  using config_test::expect_error;
  EXPECT_FALSE(load({{"precision.fp8", "delayed"}, {"precision.fp8_weight_gradient", "false"}})
                   .precision.fp8_weight_gradient);
  EXPECT_TRUE(load({{"precision.fp8", "tensorwise"}}).precision.fp8_weight_gradient);
  expect_error([] { load({{"precision.fp8_weight_gradient", "false"}}); },
               {"precision.fp8_weight_gradient = false (command line)", "precision.fp8 is none"});
  expect_error([] {
    load({{"precision.fp8", "tensorwise"}, {"precision.fp8_weight_gradient", "false"}, {"lora.rank", "8"}});
  },
               {"precision.fp8_weight_gradient = false (command line)", "frozen"});
  // On CUDA the micro-batch's tokens are contracted by the FP8 weight gradient alone.
  const ConfigOverrides odd = {{"precision.fp8", "tensorwise"}, {"training.device", "cuda"},
                               {"training.local_batch_size", "1"}, {"training.seq_len", "56"}};
  expect_error([&] { load(odd); }, {"multiple of 16", "the tokens of a micro-batch", "is 56"});
  ConfigOverrides without = odd;
  without.emplace_back("precision.fp8_weight_gradient", "false");
  EXPECT_EQ(load(without).training.seq_len, 56);
}

}  // namespace
}  // namespace forge
