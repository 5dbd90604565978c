// precision.fp8_filter_fqns on the CPU reference (NOTE [FP8 filter] in
// model/fp8_projections.h): the list's parsing; the filtered projections carry no FP8 and no
// statistics blocks (the rest numbered without them), and the FP8 FLOP share, the weight
// cache and forge info's line count none of theirs; training is bitwise the all-FP8 run
// with the filtered descriptors stripped of their FP8 settings (tensorwise and delayed), and
// with every projection filtered bitwise the run without FP8; a delayed state follows the
// projections by name into a run with another filter and is refused where a projection
// would start with no history, naming the key; FSDP's FP8 all-gather sends a filtered
// projection with the norms and its memory estimate agrees; and the configuration rules.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "cli/config.h"
#include "config_test_support.h"
#include "distributed/fsdp.h"
#include "distributed/fsdp_fp8_pieces.h"
#include "distributed/launch_env.h"
#include "expect_error.h"
#include "fp8_sgd_step.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/memory_estimate.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "stripped_fp8_source.h"

namespace forge {
namespace {

ExperimentConfig load(ConfigOverrides overrides) { return load_experiment("", overrides); }

ModelConfig four_layers() { return load({{"model.name", "debug-tiny"}, {"model.num_layers", "4"}}).model; }

Fp8Settings settings(Fp8Recipe recipe, const std::string& filter) {
  Fp8Settings s;
  s.recipe = recipe;
  s.amax_history_length = 4;
  s.filter_fqns = fp8_filter_fqns_of(filter);
  return s;
}

constexpr int64_t kBatch = 4, kSeq = 16;

double sgd_step(const ModelConfig& m, DecoderLM& model, FlatParameters& params, FlatParameters& grads,
                Fp8Projections* fp8, ParamSource& weights, GradSink& gradients) {
  return testing::fp8_sgd_step(m, model, params, grads, fp8, weights, gradients, kBatch, kSeq);
}

TEST(ModelFp8Filter, ParsesTheList) {
  EXPECT_TRUE(fp8_filter_fqns_of("").empty());
  EXPECT_TRUE(fp8_filter_fqns_of("  ").empty());
  EXPECT_EQ(fp8_filter_fqns_of("layers.0., mlp.down "), (std::vector<std::string>{"layers.0.", "mlp.down"}));
  EXPECT_EQ(fp8_filter_fqns_of("a,,b"), (std::vector<std::string>{"a", "", "b"}));
  const Fp8Settings s = settings(Fp8Recipe::Tensorwise, "layers.1.,mlp.down");
  EXPECT_TRUE(fp8_filtered("layers.1.attention.qkv.weight", s));
  EXPECT_FALSE(fp8_filtered("layers.10.attention.qkv.weight", s));  // the trailing dot
  EXPECT_TRUE(fp8_filtered("layers.10.mlp.down.weight", s));
}

TEST(ModelFp8Filter, FilteredProjectionsCarryNoFp8AndTheRestIsNumberedWithoutThem) {
  const ModelConfig m = four_layers();
  const Fp8Settings all = settings(Fp8Recipe::Tensorwise, ""), some = settings(Fp8Recipe::Tensorwise, "layers.0.,mlp.down");
  FlatParameters params(m), grads(m);
  Fp8Projections fp8(m, some, Device::CPU, 32);
  fp8.set_base(params, grads);
  int64_t blocks = 0, kept = 0, filtered = 0;
  std::vector<size_t> entry(static_cast<size_t>(m.num_layers), 0);
  for (const ParamSpec& spec : parameter_specs(m)) {
    if (spec.layer < 0) continue;
    const size_t k = entry[static_cast<size_t>(spec.layer)]++;
    const LinearWeight& w = fp8.layer(spec.layer).params.at(k);
    EXPECT_EQ(fp8.layer_grads(spec.layer).params.at(k).fp8, w.fp8) << spec.name;
    const bool out = spec.layer == 0 || spec.name.find("mlp.down") != std::string::npos;
    EXPECT_EQ(w.fp8 != nullptr, fp8_block_matrix(spec) && !out) << spec.name;
    if (fp8_block_matrix(spec) && out) {
      filtered += shape_numel(spec.shape);
      EXPECT_EQ(fp8.projection_index(spec.name), -1) << spec.name;
    }
    if (!w.fp8) continue;
    EXPECT_EQ(w.fp8->stats, fp8.statistics().data<float>() + blocks * cpu::kFp8ProjectionStats) << spec.name;
    EXPECT_EQ(fp8.projection_index(spec.name), blocks++) << spec.name;
    kept += shape_numel(spec.shape);
  }
  // 4 blocks x (qkv, o, gate/up, down): block 0's four and blocks 1-3's down kept in fp32 here.
  EXPECT_EQ(blocks, 16 - 4 - 3);
  EXPECT_EQ(fp8_projection_count(m, some), blocks);
  EXPECT_EQ(fp8_projection_count(m, all), 16);
  EXPECT_EQ(fp8_projection_names(m, some).size(), static_cast<size_t>(blocks));
  EXPECT_EQ(fp8_gemm_params(m, some), kept);
  EXPECT_EQ(fp8_gemm_params(m, all), kept + filtered);
  Fp8Settings cached = some;
  cached.weight_cache = true;
  EXPECT_EQ(fp8_weight_cache_bytes(m, cached), 2 * kept);
  EXPECT_EQ(describe_fp8_filter(m, some),
            "precision.fp8_filter_fqns 'layers.0.,mlp.down' keeps 7 of the 16 block projections in the compute "
            "dtype: layers.0.attention.qkv.weight, layers.0.attention.o.weight, layers.0.mlp.gate_up.weight, "
            "layers.0.mlp.down.weight, layers.1.mlp.down.weight, layers.2.mlp.down.weight and 1 more");
}

// The filtered run is bitwise the unfiltered FP8 run with the filtered descriptors stripped
// (so those projections take the path without FP8, every other one its FP8 path with the
// same scales), tensorwise and delayed, over 3 steps; and with every projection filtered it
// is the run without precision.fp8.
TEST(ModelFp8Filter, TrainingIsTheFp8RunWithTheFilteredProjectionsStripped) {
  const ModelConfig m = four_layers();
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed})
    for (const std::string filter : {"layers.1.,mlp.gate_up", "layers."}) {
      SCOPED_TRACE(fmt::format("{} '{}'", recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise", filter));
      DecoderLM model(m, kBatch, kSeq);
      FlatParameters params(m), grads(m), ref_params(m), ref_grads(m), plain_params(m), plain_grads(m);
      params.initialize(3);
      ref_params.flat().copy_from(params.flat());
      plain_params.flat().copy_from(params.flat());
      Fp8Projections filtered(m, settings(recipe, filter), Device::CPU, kBatch * kSeq);
      filtered.set_base(params, grads);
      Fp8Projections unfiltered(m, settings(recipe, ""), Device::CPU, kBatch * kSeq);
      unfiltered.set_base(ref_params, ref_grads);
      testing::StrippedFp8Source stripped(unfiltered, testing::strip_filtered(m, settings(recipe, filter)));
      for (int step = 0; step < 3; ++step) {
        const double loss = sgd_step(m, model, params, grads, &filtered, filtered, filtered);
        EXPECT_EQ(loss, sgd_step(m, model, ref_params, ref_grads, &unfiltered, stripped, stripped)) << step;
        EXPECT_TRUE(testing::bitwise_equal(grads.flat(), ref_grads.flat())) << "step " << step;
        if (filter != "layers.") continue;
        EXPECT_EQ(loss, sgd_step(m, model, plain_params, plain_grads, nullptr, plain_params, plain_grads)) << step;
        EXPECT_TRUE(testing::bitwise_equal(grads.flat(), plain_grads.flat())) << "step " << step;
      }
    }
}

// A delayed state saved unfiltered restores under a filter (the kept projections' histories
// and scales by name), and one saved filtered is refused by a run that would train a
// filtered projection in FP8 with no history, naming both filters and the projection.
TEST(ModelFp8Filter, DelayedStateFollowsTheProjectionsByName) {
  const ModelConfig m = four_layers();
  FlatParameters params(m), grads(m);
  params.initialize(5);
  DecoderLM model(m, kBatch, kSeq);
  Fp8Projections all(m, settings(Fp8Recipe::Delayed, ""), Device::CPU, kBatch * kSeq);
  all.set_base(params, grads);
  for (int step = 0; step < 2; ++step) sgd_step(m, model, params, grads, &all, all, all);
  const Fp8DelayedState saved = all.delayed_state();
  ASSERT_TRUE(saved.active);
  EXPECT_TRUE(saved.filter_fqns.empty());

  Fp8Projections some(m, settings(Fp8Recipe::Delayed, "mlp.down"), Device::CPU, kBatch * kSeq);
  some.restore_delayed_state(saved);
  const Fp8DelayedState restored = some.delayed_state();
  EXPECT_EQ(restored.filter_fqns, std::vector<std::string>{"mlp.down"});
  const std::vector<std::string> names = fp8_projection_names(m, settings(Fp8Recipe::Delayed, ""));
  const std::vector<std::string> kept = fp8_projection_names(m, settings(Fp8Recipe::Delayed, "mlp.down"));
  ASSERT_EQ(restored.scales.size(), kept.size() * cpu::kFp8Roles);
  const auto length = static_cast<size_t>(saved.history_length);
  for (size_t b = 0; b < kept.size(); ++b) {
    const auto from = static_cast<size_t>(std::find(names.begin(), names.end(), kept[b]) - names.begin());
    for (size_t r = 0; r < cpu::kFp8Roles; ++r) {
      EXPECT_EQ(restored.scales[b * cpu::kFp8Roles + r], saved.scales[from * cpu::kFp8Roles + r]) << kept[b];
      for (size_t i = 0; i < length; ++i)
        EXPECT_EQ(restored.histories[(b * cpu::kFp8Roles + r) * length + i],
                  saved.histories[(from * cpu::kFp8Roles + r) * length + i]);
    }
  }
  // The same state again, unfiltered: mlp.down has no history to take.
  Fp8Projections again(m, settings(Fp8Recipe::Delayed, "layers.3."), Device::CPU, kBatch * kSeq);
  expect_error([&] { again.restore_delayed_state(restored); },
               {"precision.fp8_filter_fqns 'mlp.down'", "'layers.0.mlp.down.weight'", "(precision.fp8_filter_fqns "
                                                                                      "'layers.3.')",
                "no history"});
}

// NOTE [FP8 all-gather pieces]: a filtered projection is no piece and travels with the norms,
// the codes then packed (the FP8 parameters one after the other); the memory estimate agrees
// up to the padding.
TEST(ModelFp8Filter, Fp8AllGatherSendsAFilteredProjectionWithTheNorms) {
  const ModelConfig m = four_layers();
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  const FsdpLayout layout(m, 1, 0);
  const FsdpUnit& unit = layout.units().at(1);
  const Fp8Settings filter = settings(Fp8Recipe::Tensorwise, "attention.o");
  const std::vector<Fp8GatherPiece> pieces = fp8_unit_pieces(m, layout.specs(), unit, filter);
  ASSERT_EQ(pieces.size(), 3u);  // qkv, gate/up, down
  for (const Fp8GatherPiece& piece : pieces) EXPECT_EQ(piece.projection.find("attention.o"), std::string::npos);
  int64_t codes = 0, norms = 0;
  for (const FsdpParam& p : unit.params)
    (fp8_gathered_param(layout.specs()[static_cast<size_t>(p.spec)], filter) ? codes : norms) += p.numel;
  for (int zero : {3, 1}) {
    SCOPED_TRACE(zero);
    FsdpOptions options;
    options.zero_stage = zero;
    options.fp8_all_gather = true;
    options.fp8_filter_fqns = filter.filter_fqns;
    const FsdpMemory got = Fsdp(m, Device::CPU, *group, nullptr, options).memory();
    const int64_t ends = layout.units().front().numel + layout.units().back().numel;
    const int64_t slots = zero == 3 ? 3 : 4;
    const int64_t statistics = slots * (3 * 4 + 2 * 3 * cpu::kFp8StatStride * 4);
    // Each slot: the packed codes (1 byte) and the norms with o (fp32 here); the two wires.
    EXPECT_EQ(got.compute_weights, ends * 4 + slots * (codes + norms * 4) + norms * 4 + codes + statistics);
    MemoryPlan plan;
    plan.fsdp = true;
    plan.zero_stage = zero;
    plan.fp8_all_gather = true;
    plan.fp8 = filter;
    EXPECT_NEAR(estimate_memory(m, plan).compute_weights, static_cast<double>(got.compute_weights - statistics),
                8.0 * 4 * kFsdpAlign);
  }
}

TEST(ModelFp8Filter, ConfigRules) {
  using config_test::expect_error;
  const ExperimentConfig ok = load({{"precision.fp8", "delayed"}, {"precision.fp8_filter_fqns", "layers.0., mlp.down"}});
  EXPECT_EQ(ok.precision.fp8_filter_fqns, "layers.0., mlp.down");
  expect_error([] { load({{"precision.fp8_filter_fqns", "layers.0."}}); },
               {"precision.fp8_filter_fqns = layers.0. (command line)", "precision.fp8 is none"});
  expect_error([] { load({{"precision.fp8", "tensorwise"}, {"precision.fp8_filter_fqns", "layers.0.,"}}); },
               {"precision.fp8_filter_fqns", "an empty string"});
  expect_error([] { load({{"precision.fp8", "tensorwise"}, {"precision.fp8_filter_fqns", "mlp,mlp"}}); },
               {"lists 'mlp' twice"});
  expect_error([] { load({{"precision.fp8", "tensorwise"}, {"precision.fp8_filter_fqns", "output"}}); },
               {"'output' is not part of the name of any projection", "layers.0.attention.qkv.weight",
                "precision.fp8_output_head"});
  // A MoE model's routed experts are filtered by their stack's name, unless they are out of FP8 already.
  EXPECT_NO_THROW(load({{"model.name", "debug-tiny-moe"}, {"precision.fp8", "tensorwise"},
                        {"precision.fp8_filter_fqns", "experts"}}));
  expect_error([] {
    load({{"model.name", "debug-tiny-moe"}, {"precision.fp8", "tensorwise"}, {"precision.fp8_routed_experts", "false"},
          {"precision.fp8_filter_fqns", "experts"}});
  },
               {"'experts' is not part of the name of any projection this run trains in FP8"});
}

}  // namespace
}  // namespace forge
