// precision.fp8 delayed on the CPU reference (NOTE [FP8 delayed scaling] in
// ops/fp8_linear.h, NOTE [FP8 step end] in model/fp8_projections.h): the statistics blocks'
// step-end pass against Transformer Engine's update rule, the first step's current scales,
// a delayed step that must equal the tensorwise one bitwise when its scales are the same,
// the non-finite amax named, skipped steps, and the state checkpoints keep.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model_testing.h"
#include "ops/fp8_statistics.h"
#include "ops_testing.h"

namespace forge {
namespace {

using cpu::Fp8Role;

Fp8Settings delayed(int64_t history = 4, cpu::Fp8AmaxAlgorithm algorithm = cpu::Fp8AmaxAlgorithm::Max) {
  Fp8Settings s;
  s.recipe = Fp8Recipe::Delayed;
  s.amax_history_length = history;
  s.amax_algorithm = algorithm;
  return s;
}

float& seen(Tensor& stats, int64_t p, Fp8Role r) { return stats.data<float>()[cpu::fp8_seen_offset(p, r)]; }
float scale(const Tensor& stats, int64_t p, Fp8Role r) { return stats.data<float>()[cpu::fp8_scale_offset(p, r)]; }
float scale_inv(const Tensor& stats, int64_t p, Fp8Role r) {
  return stats.data<float>()[cpu::fp8_scale_inv_offset(p, r)];
}

// The step-end pass over many blocks is fp8_delayed_scale_update per (projection, role),
// with x and W in E4M3 and dy in the gradient format, and zeroes every seen amax.
TEST(Fp8Delayed, StepEndIsTransformerEnginesUpdatePerRole) {
  const int64_t projections = 3, length = 3;
  Tensor stats = Tensor::empty({projections * cpu::kFp8ProjectionStats});
  fp8_stats_init(stats);
  Tensor history = Tensor::zeros({projections * cpu::kFp8Roles * length});
  const cpu::Fp8DelayedRecipe recipe{length, cpu::Fp8AmaxAlgorithm::Max, 1.0f, Fp8Format::E5M2};
  std::vector<std::vector<float>> reference(projections * cpu::kFp8Roles, std::vector<float>(length, 0.0f));
  std::vector<float> reference_scale(projections * cpu::kFp8Roles, 1.0f);
  for (int step = 0; step < 5; ++step) {
    for (int64_t p = 0; p < projections; ++p)
      for (int r = 0; r < cpu::kFp8Roles; ++r) {
        const float amax = step == 1 && p == 1 ? 1000.0f : 1.0f + static_cast<float>(p + r + step);  // a spike
        seen(stats, p, static_cast<Fp8Role>(r)) = amax;
        std::vector<float>& h = reference[p * cpu::kFp8Roles + r];
        h[0] = amax;
        reference_scale[p * cpu::kFp8Roles + r] =
            cpu::fp8_delayed_scale_update(h.data(), length, reference_scale[p * cpu::kFp8Roles + r],
                                          cpu::Fp8AmaxAlgorithm::Max, 1.0f, r == 2 ? Fp8Format::E5M2 : Fp8Format::E4M3);
      }
    fp8_stats_delayed_step(stats, history, recipe);
    for (int64_t p = 0; p < projections; ++p)
      for (int r = 0; r < cpu::kFp8Roles; ++r) {
        const auto role = static_cast<Fp8Role>(r);
        EXPECT_EQ(scale(stats, p, role), reference_scale[p * cpu::kFp8Roles + r]) << step << " " << p << " " << r;
        EXPECT_EQ(scale_inv(stats, p, role), 1.0f / reference_scale[p * cpu::kFp8Roles + r]);
        EXPECT_EQ(seen(stats, p, role), 0.0f);
        const std::vector<float> got(history.data<float>() + (p * cpu::kFp8Roles + r) * length,
                                     history.data<float>() + (p * cpu::kFp8Roles + r + 1) * length);
        EXPECT_EQ(got, reference[p * cpu::kFp8Roles + r]);
      }
  }
  // The spike (step 1, projection 1) has rolled out of the 3-step window by step 4.
  EXPECT_EQ(scale(stats, 1, Fp8Role::X), 448.0f * 0.5f / (1.0f + 1 + 0 + 4));
}

// Which slot holds the first non-finite seen amax, in projection then role order.
TEST(Fp8Delayed, FirstNonFiniteSeenAmax) {
  Tensor stats = Tensor::empty({4 * cpu::kFp8ProjectionStats});
  fp8_stats_init(stats);
  EXPECT_EQ(fp8_stats_first_nonfinite(stats), -1);
  seen(stats, 3, Fp8Role::X) = INFINITY;
  seen(stats, 2, Fp8Role::Dy) = NAN;
  EXPECT_EQ(fp8_stats_first_nonfinite(stats), 2 * cpu::kFp8Roles + 2);
  EXPECT_TRUE(std::isnan(fp8_stats_seen(stats, 2 * cpu::kFp8Roles + 2)));
  fp8_stats_clear_seen(stats);
  EXPECT_EQ(fp8_stats_first_nonfinite(stats), -1);
}

struct TinyRun {
  ModelConfig config = testing::tiny();
  int64_t batch = 2, seq = 8;
  FlatParameters params{config};
  Tensor tokens = testing::random_tokens(batch, seq, config.vocab_size, 3);
  Tensor targets = testing::random_tokens(batch, seq, config.vocab_size, 4);
  DecoderLM model{config, batch, seq};
  TinyRun() { params.initialize(5); }

  // One micro-batch through `fp8`; the loss, and the gradients in `grads`.
  double step(Fp8Projections& fp8, FlatParameters& grads) {
    fp8.set_base(params, grads);
    grads.discard();
    return model.forward_backward(tokens, targets, fp8, fp8, 1.0f / static_cast<float>(batch * seq)).mean();
  }
};

// The first step of a delayed run has no history and quantizes with current scales, as
// tensorwise: bitwise the same. The step's end records each tensor's amax (W's is max |W|)
// and sets the scales from them. The next micro-batch, on the same weights and tokens, then
// quantizes with scales equal to the current ones (a history holding this amax alone), so
// it is bitwise the tensorwise step again, through the delayed code path.
TEST(Fp8Delayed, FirstStepIsCurrentScalingAndTheNextUsesTheHistory) {
  TinyRun run;
  FlatParameters g_tensorwise(run.config), g_first(run.config), g_second(run.config);
  Fp8Projections tensorwise(run.config, {}, Device::CPU, run.batch * run.seq);
  Fp8Projections fp8(run.config, delayed(), Device::CPU, run.batch * run.seq);
  const double want = run.step(tensorwise, g_tensorwise);
  EXPECT_EQ(run.step(fp8, g_first), want);
  EXPECT_TRUE(testing::bitwise_equal(g_first.flat(), g_tensorwise.flat()));
  EXPECT_EQ(fp8.nonfinite_amax(), "");
  fp8.end_step(true);

  const Fp8DelayedState state = fp8.delayed_state();
  EXPECT_TRUE(state.active);
  ASSERT_EQ(state.scales.size(), static_cast<size_t>(2 * 4 * cpu::kFp8Roles));  // 2 layers x qkv, o, gate_up, down
  int64_t projection = 0;
  for (const ParamSpec& spec : run.params.specs()) {
    if (spec.layer < 0 || spec.shape.size() != 2) continue;
    const Tensor& w = run.params.tensors()[&spec - run.params.specs().data()];
    float amax = 0.0f;
    for (int64_t i = 0; i < w.numel(); ++i) amax = std::max(amax, std::fabs(w.data<float>()[i]));
    EXPECT_EQ(state.scales[projection * cpu::kFp8Roles + 1], 448.0f / amax) << spec.name;
    EXPECT_EQ(state.histories[(projection * cpu::kFp8Roles + 1) * 4 + 3], amax) << spec.name;  // newest last
    for (int r = 0; r < cpu::kFp8Roles; ++r) EXPECT_GT(state.scales[projection * cpu::kFp8Roles + r], 0.0f);
    ++projection;
  }

  EXPECT_EQ(run.step(fp8, g_second), want);
  EXPECT_TRUE(testing::bitwise_equal(g_second.flat(), g_tensorwise.flat()));
}

// With a scale from a larger amax in the history (a spike), the delayed step quantizes more
// coarsely than the tensorwise one: a different, still close, result; "most_recent" forgets
// the spike at once.
TEST(Fp8Delayed, ScalesFromTheHistoryChangeTheStep) {
  TinyRun run;
  FlatParameters g_tensorwise(run.config), g(run.config);
  Fp8Projections tensorwise(run.config, {}, Device::CPU, run.batch * run.seq);
  const double want = run.step(tensorwise, g_tensorwise);
  for (auto algorithm : {cpu::Fp8AmaxAlgorithm::Max, cpu::Fp8AmaxAlgorithm::MostRecent}) {
    Fp8Projections fp8(run.config, delayed(4, algorithm), Device::CPU, run.batch * run.seq);
    run.step(fp8, g);
    fp8.end_step(true);
    // A spike: every amax of the next step's recorded history is 16 times larger.
    Fp8DelayedState state = fp8.delayed_state();
    for (float& h : state.histories) h *= 16.0f;
    for (float& s : state.scales) s /= 16.0f;
    fp8.restore_delayed_state(state);
    const double spiked = run.step(fp8, g);
    EXPECT_NE(spiked, want);
    EXPECT_NEAR(spiked, want, 0.02 * want);
    fp8.end_step(true);
    const double next = run.step(fp8, g);
    if (algorithm == cpu::Fp8AmaxAlgorithm::MostRecent)
      EXPECT_EQ(next, want);  // the scale of this step's own amax again
    else
      EXPECT_EQ(next, spiked);  // the spike is still in the window
  }
}

// A non-finite amax is named by parameter and role; a skipped step (end_step(false)) drops
// the step's amaxes and leaves the histories and scales as they were.
TEST(Fp8Delayed, NonFiniteAmaxIsNamedAndASkippedStepChangesNothing) {
  TinyRun run;
  FlatParameters g(run.config);
  Fp8Projections fp8(run.config, delayed(), Device::CPU, run.batch * run.seq);
  run.step(fp8, g);
  fp8.end_step(true);
  const Fp8DelayedState before = fp8.delayed_state();
  const ParamSpec* down = nullptr;
  for (const ParamSpec& spec : run.params.specs())
    if (spec.layer == 1 && spec.name.find("down") != std::string::npos) down = &spec;
  ASSERT_NE(down, nullptr);
  const Tensor& w = run.params.tensors()[down - run.params.specs().data()];
  const float kept = w.data<float>()[5];
  w.data<float>()[5] = INFINITY;
  run.step(fp8, g);
  EXPECT_EQ(fp8.nonfinite_amax(), "'" + down->name + "' weight W: amax inf");
  fp8.end_step(false);
  EXPECT_EQ(fp8.nonfinite_amax(), "");
  const Fp8DelayedState after = fp8.delayed_state();
  EXPECT_EQ(after.histories, before.histories);
  EXPECT_EQ(after.scales, before.scales);
  w.data<float>()[5] = kept;

  // (Delayed scales saturate the inf weight, so the step itself stayed finite: only its amax
  // tells.) Tensorwise records the amaxes too. A NaN weight there makes the forward NaN, so
  // every dy is NaN, and the first in parameter order is the first projection's.
  Fp8Projections tensorwise(run.config, {}, Device::CPU, run.batch * run.seq);
  w.data<float>()[5] = NAN;
  run.step(tensorwise, g);
  const ParamSpec* first = nullptr;
  for (const ParamSpec& spec : run.params.specs())
    if (!first && spec.layer == 0 && spec.shape.size() == 2) first = &spec;
  EXPECT_EQ(tensorwise.nonfinite_amax(), "'" + first->name + "' output gradient dy: amax nan");
  w.data<float>()[5] = kept;
}

// The state a checkpoint keeps restores into a new run bitwise, and a state of another
// shape is refused naming what differs.
TEST(Fp8Delayed, StateRoundTripsAndMismatchesAreRefused) {
  TinyRun run;
  FlatParameters g(run.config), g2(run.config), g3(run.config);
  Fp8Projections fp8(run.config, delayed(), Device::CPU, run.batch * run.seq);
  run.step(fp8, g);
  fp8.end_step(true);
  run.step(fp8, g);
  fp8.end_step(true);
  const Fp8DelayedState state = fp8.delayed_state();
  Fp8Projections resumed(run.config, delayed(), Device::CPU, run.batch * run.seq);
  resumed.restore_delayed_state(state);
  EXPECT_EQ(resumed.delayed_state().histories, state.histories);
  EXPECT_EQ(resumed.delayed_state().scales, state.scales);
  EXPECT_EQ(run.step(resumed, g2), run.step(fp8, g3));
  EXPECT_TRUE(testing::bitwise_equal(g2.flat(), g3.flat()));

  Fp8Projections longer(run.config, delayed(8), Device::CPU, run.batch * run.seq);
  expect_error([&] { longer.restore_delayed_state(state); },
               {"amax history length is 4", "precision.fp8_amax_history_len is 8"});
  Fp8DelayedState fewer = state;
  fewer.scales.resize(3);
  fewer.histories.resize(12);
  expect_error([&] { resumed.restore_delayed_state(fewer); }, {"holds 3 scales and 12 history values", "needs 24"});
}

}  // namespace
}  // namespace forge
