// precision.fp8_routed_experts false on the CPU reference (NOTE [FP8 routed experts switch] in
// model/fp8_projections.h): the routed experts' stacks carry no FP8 and no statistics blocks
// (the rest numbered without them), the scratch, weight cache and FP8 FLOP share count none
// of theirs; training (full, and LoRA over the frozen base) is bitwise the run that takes the
// all-FP8 projections and strips the FP8 settings from the expert stacks' descriptors (so the
// experts run exactly the path without precision.fp8 and everything else exactly the FP8
// path); a delayed state saved with the experts in FP8 restores without them, bitwise as the
// uninterrupted run, and one saved without them is refused with them, naming the key; the
// checkpoint metadata keeps the setting; and the config rules.
#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_metadata.h"
#include "cli/config.h"
#include "config_test_support.h"
#include "fp8_sgd_step.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/lora.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "stripped_fp8_source.h"

namespace forge {
namespace {

using config_test::expect_error;

ExperimentConfig load(ConfigOverrides overrides) { return load_experiment("", overrides); }

// Mixtral-shaped: 2 blocks of 4 experts, top-2. DeepSeek-V2-shaped: MLA, a dense first
// block, then 8 experts (top-2) and a shared expert.
ModelConfig mixtral_like() { return load({{"model.name", "debug-tiny-moe"}}).model; }
ModelConfig deepseek_like() { return load({{"model.name", "debug-tiny-mla"}}).model; }

Fp8Settings settings(Fp8Recipe recipe, bool routed_experts, bool frozen = false) {
  Fp8Settings s;
  s.recipe = recipe;
  s.amax_history_length = 4;
  s.routed_experts = routed_experts;
  s.frozen = frozen;
  return s;
}

constexpr int64_t kBatch = 4, kSeq = 16;

double sgd_step(const ModelConfig& m, DecoderLM& model, FlatParameters& params, FlatParameters& grads,
                Fp8Projections& fp8, ParamSource& weights, GradSink& gradients) {
  return testing::fp8_sgd_step(m, model, params, grads, &fp8, weights, gradients, kBatch, kSeq);
}

TEST(ModelFp8RoutedExperts, StacksCarryNoFp8AndTheRestIsNumberedWithoutThem) {
  const ModelConfig m = deepseek_like();
  const Fp8Settings off = settings(Fp8Recipe::Tensorwise, false), on = settings(Fp8Recipe::Tensorwise, true);
  FlatParameters params(m), grads(m);
  Fp8Projections fp8(m, off, Device::CPU, 32);
  fp8.set_base(params, grads);
  int64_t blocks = 0, plain = 0, experts = 0;
  std::vector<size_t> entry(static_cast<size_t>(m.num_layers), 0);
  for (const ParamSpec& spec : parameter_specs(m)) {
    if (spec.layer < 0) continue;
    const size_t k = entry[static_cast<size_t>(spec.layer)]++;
    const LinearWeight& w = fp8.layer(spec.layer).params.at(k);
    const LinearWeight& g = fp8.layer_grads(spec.layer).params.at(k);
    EXPECT_EQ(w.fp8 != nullptr, fp8_block_matrix(spec)) << spec.name;
    EXPECT_EQ(g.fp8, w.fp8) << spec.name;
    EXPECT_FALSE(fp8_expert_stack(spec, off)) << spec.name;
    EXPECT_EQ(fp8_expert_stack(spec, on), spec.expert_stack) << spec.name;
    if (spec.expert_stack) {
      experts += shape_numel(spec.shape);
      EXPECT_EQ(fp8.projection_index(spec.name + " (expert 0)"), -1) << spec.name;
    }
    if (!w.fp8) continue;
    EXPECT_EQ(w.fp8->stats, fp8.statistics().data<float>() + blocks * cpu::kFp8ProjectionStats) << spec.name;
    EXPECT_EQ(fp8.projection_index(spec.name), blocks++) << spec.name;
    plain += shape_numel(spec.shape);
  }
  // Layer 0 dense (q, kv_a, kv_b, o, gate_up, down); layers 1 and 2 the same attention and
  // the two shared expert matrices; with the experts, 2 x 8 blocks more per MoE layer.
  EXPECT_EQ(blocks, 6 + 2 * (4 + 2));
  EXPECT_EQ(fp8_projection_count(m, off), blocks);
  EXPECT_EQ(fp8_projection_count(m, on), blocks + 2 * 16);
  EXPECT_EQ(fp8.statistics().numel(), blocks * cpu::kFp8ProjectionStats);
  // forge info's FP8 share: the experts' k of E no more; no cache, no row codes of theirs.
  EXPECT_EQ(fp8_gemm_params(m, off), plain);
  EXPECT_EQ(fp8_gemm_params(m, on), plain + experts * 2 / 8);
  Fp8Settings cached = off;
  cached.weight_cache = true;
  EXPECT_EQ(fp8_weight_cache_bytes(m, cached), 2 * plain);
  EXPECT_EQ(fp8_expert_row_codes(m, off, 64), 0);
  EXPECT_GT(fp8_expert_row_codes(m, on, 64), 0);
  // The scratch loses the row codes, 32 expert matrices' forward statistics and blocks.
  EXPECT_EQ(fp8_scratch_bytes(m, on, 64) - fp8_scratch_bytes(m, off, 64),
            3 * (fp8_workspace_codes(m, on, 64) - fp8_workspace_codes(m, off, 64)) + fp8_expert_row_codes(m, on, 64) +
                32 * (kFp8WorkspaceStats + cpu::kFp8ProjectionStats) * 4);
  Fp8Settings delayed = off;
  delayed.recipe = Fp8Recipe::Delayed;
  EXPECT_EQ(fp8_scratch_bytes(m, delayed, 64) - fp8_scratch_bytes(m, off, 64),
            blocks * cpu::kFp8Roles * delayed.amax_history_length * 4);
  // Mixtral-shaped: only attention is left in FP8 (2 layers x qkv, o).
  EXPECT_EQ(fp8_projection_count(mixtral_like(), off), 4);
}

// The run with the switch off is bitwise the all-FP8 projections' with the expert stacks
// stripped (StrippedFp8Source with strip_routed_experts), tensorwise and delayed, over 3 steps: every projection but the
// experts takes its FP8 path with the same scales, the experts the one without FP8. And
// their gradients differ from the all-FP8 run's (there the experts did run in FP8).
TEST(ModelFp8RoutedExperts, TrainingIsTheFp8RunWithTheExpertsStripped) {
  for (const ModelConfig& m : {mixtral_like(), deepseek_like()})
    for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
      SCOPED_TRACE(fmt::format("{} {}", m.mla() ? "deepseek" : "mixtral",
                               recipe == Fp8Recipe::Delayed ? "delayed" : "tensorwise"));
      DecoderLM model(m, kBatch, kSeq);
      FlatParameters params(m), grads(m), ref_params(m), ref_grads(m), all_params(m), all_grads(m);
      params.initialize(3);
      ref_params.flat().copy_from(params.flat());
      all_params.flat().copy_from(params.flat());
      Fp8Projections off(m, settings(recipe, false), Device::CPU, kBatch * kSeq);
      off.set_base(params, grads);
      Fp8Projections on(m, settings(recipe, true), Device::CPU, kBatch * kSeq);
      on.set_base(ref_params, ref_grads);
      testing::StrippedFp8Source stripped(on, testing::strip_routed_experts());
      Fp8Projections all(m, settings(recipe, true), Device::CPU, kBatch * kSeq);
      all.set_base(all_params, all_grads);
      for (int step = 0; step < 3; ++step) {
        const double loss = sgd_step(m, model, params, grads, off, off, off);
        const double want = sgd_step(m, model, ref_params, ref_grads, on, stripped, stripped);
        const double fp8_experts = sgd_step(m, model, all_params, all_grads, all, all, all);
        EXPECT_EQ(loss, want) << "step " << step;
        EXPECT_TRUE(testing::bitwise_equal(grads.flat(), ref_grads.flat())) << "step " << step;
        EXPECT_TRUE(testing::bitwise_equal(params.flat(), ref_params.flat())) << "step " << step;
        if (step > 0) continue;
        EXPECT_NE(loss, fp8_experts);
        for (size_t k = 0; k < grads.specs().size(); ++k)
          if (grads.specs()[k].expert_stack)
            EXPECT_FALSE(testing::bitwise_equal(grads.tensors()[k], all_grads.tensors()[k])) << grads.specs()[k].name;
      }
    }
}

// LoRA over the frozen FP8 base (NOTE [FP8 frozen base]): with the switch off the frozen
// experts and their adapters run in the compute dtype, bitwise as the stripped reference.
TEST(ModelFp8RoutedExperts, LoraOverTheFrozenBaseIsTheFp8RunWithTheExpertsStripped) {
  const ModelConfig m = deepseek_like();
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8.0;
  lora.target_modules = "q_proj,kv_b_proj,o_proj,gate_proj,up_proj,down_proj,experts.gate_up_proj,experts.down_proj";
  FlatParameters base(m);
  base.initialize(3);
  DecoderLM model(m, kBatch, kSeq);
  const testing::Fp8TestBatch b = testing::fp8_test_batch(m, kBatch, kSeq);
  for (const Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    Fp8Projections off(m, settings(recipe, false, true), Device::CPU, kBatch * kSeq);
    off.set_base(base);
    Fp8Projections on(m, settings(recipe, true, true), Device::CPU, kBatch * kSeq);
    on.set_base(base);
    testing::StrippedFp8Source stripped(on, testing::strip_routed_experts(), true);
    LoraAdapters got(m, lora, Device::CPU, kBatch * kSeq), want(m, lora, Device::CPU, kBatch * kSeq);
    got.initialize(5);
    want.initialize(5);
    got.set_base(off);
    want.set_base(stripped);
    auto run = [&](LoraAdapters& adapters, Fp8Projections& fp8) {
      adapters.discard();
      const double loss = model.forward_backward(b.tokens, b.targets, adapters, adapters, 1.0f / (kBatch * kSeq)).mean();
      EXPECT_EQ(fp8.nonfinite_amax(), "");
      fp8.end_step(true);
      return loss;
    };
    for (int step = 0; step < 3; ++step) {
      const double loss = run(got, off), reference = run(want, on);
      EXPECT_EQ(loss, reference) << "step " << step;
      EXPECT_TRUE(testing::bitwise_equal(got.gradient_flat(), want.gradient_flat())) << "step " << step;
      for (LoraAdapters* a : {&got, &want}) {
        float* p = a->master_flat().data<float>();
        const float* g = a->gradient_flat().data<float>();
        for (int64_t i = 0; i < a->master_flat().numel(); ++i) p[i] -= 0.5f * g[i];
      }
    }
  }
}

// NOTE [FP8 routed experts switch]: a delayed state saved with the experts in FP8 restores
// into a run without them (their blocks dropped, every other block's histories and scales
// in order), which then steps bitwise as the uninterrupted stripped reference; a state saved
// without them is refused by a run with them, naming the key; a state restores under its own
// setting.
TEST(ModelFp8RoutedExperts, DelayedStateAcrossTheSwitch) {
  const ModelConfig m = deepseek_like();
  DecoderLM model(m, kBatch, kSeq);
  FlatParameters ref_params(m), ref_grads(m), params(m), grads(m);
  ref_params.initialize(7);
  Fp8Projections on(m, settings(Fp8Recipe::Delayed, true), Device::CPU, kBatch * kSeq);
  on.set_base(ref_params, ref_grads);
  testing::StrippedFp8Source stripped(on, testing::strip_routed_experts());
  for (int step = 0; step < 3; ++step) sgd_step(m, model, ref_params, ref_grads, on, stripped, stripped);
  const Fp8DelayedState saved = on.delayed_state();
  EXPECT_TRUE(saved.routed_experts);
  ASSERT_EQ(saved.scales.size(), static_cast<size_t>(fp8_projection_count(m, settings(Fp8Recipe::Delayed, true))) * 3);
  params.flat().copy_from(ref_params.flat());
  Fp8Projections off(m, settings(Fp8Recipe::Delayed, false), Device::CPU, kBatch * kSeq);
  off.set_base(params, grads);
  off.restore_delayed_state(saved);
  const Fp8DelayedState restored = off.delayed_state();
  EXPECT_FALSE(restored.routed_experts);
  EXPECT_TRUE(restored.active);
  ASSERT_EQ(restored.scales.size(), static_cast<size_t>(6 + 2 * (4 + 2)) * 3);
  for (const char* name : {"layers.0.attention.o.weight", "layers.2.moe.shared.down.weight"}) {
    const int64_t a = on.projection_index(name), b = off.projection_index(name);
    ASSERT_GE(a, 0) << name;
    ASSERT_GE(b, 0) << name;
    for (int r = 0; r < 3; ++r) EXPECT_EQ(restored.scales[b * 3 + r], saved.scales[a * 3 + r]) << name;
    for (int64_t i = 0; i < 3 * 4; ++i) EXPECT_EQ(restored.histories[b * 12 + i], saved.histories[a * 12 + i]) << name;
  }
  for (int step = 0; step < 2; ++step) {
    const double want = sgd_step(m, model, ref_params, ref_grads, on, stripped, stripped);
    EXPECT_EQ(sgd_step(m, model, params, grads, off, off, off), want) << "step " << step;
    EXPECT_TRUE(testing::bitwise_equal(params.flat(), ref_params.flat())) << "step " << step;
  }
  // Saved without the experts: restores so, refused with them.
  const Fp8DelayedState without = off.delayed_state();
  Fp8Projections again(m, settings(Fp8Recipe::Delayed, false), Device::CPU, kBatch * kSeq);
  again.restore_delayed_state(without);
  EXPECT_EQ(again.delayed_state().scales, without.scales);
  EXPECT_EQ(again.delayed_state().histories, without.histories);
  Fp8Projections with(m, settings(Fp8Recipe::Delayed, true), Device::CPU, kBatch * kSeq);
  expect_error([&] { with.restore_delayed_state(without); },
               {"saved with precision.fp8_routed_experts false", "this run sets it true",
                "resume with precision.fp8_routed_experts false"});
  // A truncated state saved with the experts is refused with the count it needed.
  Fp8DelayedState short_state = saved;
  short_state.scales.resize(3);
  short_state.histories.resize(12);
  expect_error([&] { again.restore_delayed_state(short_state); },
               {"holds 3 scales and 12 history values", "precision.fp8_routed_experts true"});
}

// The checkpoint metadata keeps the setting; metadata without it (saved before the switch,
// the experts then always in FP8) reads as true.
TEST(ModelFp8RoutedExperts, CheckpointMetadataKeepsTheSetting) {
  CheckpointMetadata md;
  md.model = deepseek_like();
  md.flat_numel = 8;
  md.shards = {{0, 8}};
  md.tensors = {{"w", FlatState::Param, {2, 4}, 0, {{0, 0, 0, 32, 0}}}};
  Fp8DelayedState state;
  state.active = true;
  state.history_length = 2;
  state.routed_experts = false;
  state.scales = {1.0f, 2.0f, 4.0f};
  state.histories = {0.5f, 0.25f, 1.0f, 2.0f, 0.0f, 3.0f};
  md.training.fp8_delayed = state;
  const std::string text = metadata_to_json(md);
  const CheckpointMetadata back = metadata_from_json(text, "ck/metadata.json");
  ASSERT_TRUE(back.training.fp8_delayed.has_value());
  EXPECT_FALSE(back.training.fp8_delayed->routed_experts);
  EXPECT_EQ(back.training.fp8_delayed->scales, state.scales);
  nlohmann::json j = nlohmann::json::parse(text);
  j["fp8_delayed"].erase("routed_experts");
  EXPECT_TRUE(metadata_from_json(j.dump(), "ck/metadata.json").training.fp8_delayed->routed_experts);
  j["fp8_delayed"]["routed_experts"] = "no";
  expect_error([&] { metadata_from_json(j.dump(), "ck/metadata.json"); }, {"ck/metadata.json", "routed_experts"});
}

// precision.fp8_routed_experts: false needs precision.fp8 and a MoE model; on CUDA the
// routed experts' width need not be a multiple of 16 then (the shared experts' must).
TEST(ModelFp8RoutedExperts, ConfigRules) {
  EXPECT_TRUE(load({{"model.name", "debug-tiny-moe"}, {"precision.fp8", "tensorwise"}}).precision.fp8_routed_experts);
  for (const char* recipe : {"tensorwise", "delayed"})
    EXPECT_FALSE(load({{"model.name", "debug-tiny-mla"}, {"precision.fp8", recipe},
                       {"precision.fp8_routed_experts", "false"}})
                     .precision.fp8_routed_experts);
  expect_error([] { load({{"model.name", "debug-tiny-moe"}, {"precision.fp8_routed_experts", "false"}}); },
               {"precision.fp8_routed_experts = false (command line)", "precision.fp8 is none",
                "set precision.fp8 tensorwise or delayed"});
  expect_error([] { load({{"model.name", "debug-tiny"}, {"precision.fp8", "tensorwise"},
                          {"precision.fp8_routed_experts", "false"}}); },
               {"precision.fp8_routed_experts = false (command line)", "this model has none"});
  expect_error([] { load({{"model.name", "debug-tiny-moe"}, {"precision.fp8", "tensorwise"},
                          {"precision.fp8_routed_experts", "maybe"}}); },
               {"precision.fp8_routed_experts"});
  // CUDA (8 experts, as CUDA's router wants): a routed experts' width of 40 is no FP8 GEMM's
  // without them; Mixtral-shaped has no shared expert.
  const ConfigOverrides cuda = {{"model.name", "debug-tiny-moe"},   {"model.num_experts", "8"},
                                {"precision.fp8", "tensorwise"},     {"training.device", "cuda"},
                                {"training.local_batch_size", "1"},  {"training.seq_len", "64"},
                                {"model.moe_ffn_hidden_size", "40"}};
  expect_error([&] { load(cuda); }, {"model.moe_ffn_hidden_size (the routed and shared experts' width) is 40"});
  ConfigOverrides off = cuda;
  off.emplace_back("precision.fp8_routed_experts", "false");
  EXPECT_FALSE(load(off).precision.fp8_routed_experts);
  // DeepSeek-shaped: the shared expert (1 x 40) still runs in FP8.
  ConfigOverrides shared = off;
  shared[0] = {"model.name", "debug-tiny-mla"};
  expect_error([&] { load(shared); }, {"the shared experts' width (num_shared_experts × moe_ffn_hidden_size) is 40"});
  // FSDP's FP8 all-gather with the switch off: the stacks travel in the compute dtype, with the
  // router (NOTE [FP8 all-gather pieces] in distributed/fsdp_fp8_pieces.h).
  const ExperimentConfig gathered = load({{"model.name", "debug-tiny-moe"}, {"precision.fp8", "tensorwise"},
                                          {"precision.fp8_routed_experts", "false"},
                                          {"precision.fp8_fsdp_all_gather", "true"},
                                          {"parallelism.data_parallel_shard_degree", "2"}});
  EXPECT_TRUE(gathered.precision.fp8_fsdp_all_gather);
  EXPECT_FALSE(gathered.precision.fp8_routed_experts);
  // LoRA over the frozen FP8 base takes the switch too.
  EXPECT_FALSE(load({{"model.name", "debug-tiny-mla"}, {"precision.fp8", "tensorwise"}, {"lora.rank", "4"},
                     {"precision.fp8_routed_experts", "false"}})
                   .precision.fp8_routed_experts);
}

}  // namespace
}  // namespace forge
