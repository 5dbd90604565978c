// FSDP over a pipeline rank's stages (FsdpOptions::pipeline_stages, NOTE [FSDP] and NOTE
// [FSDP layout]): the layout holds the stages' parameters only, at the whole model's flat
// offsets, every element in exactly one rank's segments; ZeRO-1 over thread ranks (the CPU
// process group), each running its share of a step's micro-batches through a stage's
// DecoderLM with the reduction held back to reduce_gradients(), gives the gradients one
// rank holding the stage's parameters gets from all the micro-batches (and gather_to_host
// the whole flat vector with the stage's weights in place); and what it refuses. ZeRO-2/3
// over the stages: test_distributed_fsdp_pipeline_zero.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <set>

#include "cli/config.h"
#include "core/rng.h"
#include "distributed/fsdp.h"
#include "distributed/fsdp_fp8_pieces.h"
#include "distributed/fsdp_layout.h"
#include "distributed/launch_env.h"
#include "expect_error.h"
#include "model/decoder_lm.h"
#include "model/memory_estimate.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;

ModelConfig four_layers() {
  return load_experiment("", {{"model.name", "debug-tiny"}, {"model.num_layers", "4"}}).model;
}

constexpr PipelineStage kFirst{0, 2, true, false}, kMiddle{1, 3, false, false}, kLast{2, 4, false, true};

// Each parameter's first element in the whole model's flat index space, by name.
std::map<std::string, int64_t> whole_offsets(const ModelConfig& config) {
  std::map<std::string, int64_t> at;
  int64_t offset = 0;
  for (const ParamSpec& spec : parameter_specs(config)) {
    at[spec.name] = offset;
    offset += shape_numel(spec.shape);
  }
  return at;
}

std::set<std::string> names_of(const std::vector<ParamSpec>& specs) {
  std::set<std::string> names;
  for (const ParamSpec& s : specs) names.insert(s.name);
  return names;
}

TEST(FsdpPipeline, LayoutHoldsTheStagesParametersAtTheWholeModelsOffsets) {
  const ModelConfig m = four_layers();
  const std::map<std::string, int64_t> offsets = whole_offsets(m);
  const std::vector<ParamSpec> whole = parameter_specs(m);
  for (const PipelineStage& stage : {kFirst, kMiddle, kLast}) {
    const std::vector<ParamSpec> held = pipeline_stage_specs(whole, {stage});
    const std::set<std::string> held_names = names_of(held);
    int64_t held_numel = 0;
    for (const ParamSpec& s : held) held_numel += shape_numel(s.shape);
    for (int world = 1; world <= 3; ++world) {
      SCOPED_TRACE(fmt::format("blocks [{}, {}), world {}", stage.first_layer, stage.end_layer, world));
      std::map<int, std::vector<std::pair<int64_t, int64_t>>> covered;  // spec -> [begin, end)
      for (int rank = 0; rank < world; ++rank) {
        const FsdpLayout layout(m, world, rank, 1, {}, {stage});
        ASSERT_EQ(layout.num_units(), m.num_layers + 2);  // the numbering is the whole model's
        ASSERT_EQ(layout.specs().size(), whole.size());   // spec indexes the whole model's
        EXPECT_EQ(layout.holds(FsdpLayout::kEmbeddingUnit), stage.embedding);
        EXPECT_EQ(layout.holds(layout.head_unit()), stage.head);
        for (int i = 0; i < m.num_layers; ++i)
          EXPECT_EQ(layout.holds(FsdpLayout::unit_of_layer(i)), i >= stage.first_layer && i < stage.end_layer) << i;
        int64_t full = 0, shard = 0;
        for (int u = 0; u < layout.num_units(); ++u) {
          const FsdpUnit& unit = layout.units()[static_cast<size_t>(u)];
          if (!layout.holds(u)) {
            EXPECT_TRUE(unit.parts.empty()) << u;
            EXPECT_EQ(unit.numel, 0) << u;
            EXPECT_EQ(unit.shard_numel, 0) << u;
          } else {
            EXPECT_EQ(unit.numel, unit.shard_numel * world);
            EXPECT_EQ(unit.shard_numel % kFsdpAlign, 0);
          }
          EXPECT_EQ(unit.full_offset, full);
          EXPECT_EQ(unit.shard_offset, shard);
          full += unit.numel;
          shard += unit.shard_numel;
          for (const FsdpParam& p : unit.params)
            EXPECT_EQ(p.flat_offset, offsets.at(whole[static_cast<size_t>(p.spec)].name));
        }
        EXPECT_EQ(layout.full_numel(), full);
        EXPECT_EQ(layout.shard_numel(), shard);
        EXPECT_EQ(layout.parameter_count(), held_numel);
        EXPECT_EQ(layout.flat_numel(), FlatParameters(m).flat().numel());
        for (const FsdpSegment& s : layout.segments()) {
          const ParamSpec& spec = whole[static_cast<size_t>(s.spec)];
          EXPECT_TRUE(held_names.count(spec.name)) << spec.name;
          EXPECT_EQ(s.flat_offset, offsets.at(spec.name) + s.param_begin) << spec.name;
          covered[s.spec].push_back({s.param_begin, s.param_begin + s.numel});
        }
      }
      ASSERT_EQ(covered.size(), held.size());
      for (auto& [spec, ranges] : covered) {
        std::sort(ranges.begin(), ranges.end());
        int64_t next = 0;
        for (auto [begin, end] : ranges) {
          EXPECT_EQ(begin, next) << whole[static_cast<size_t>(spec)].name;
          next = end;
        }
        EXPECT_EQ(next, shape_numel(whole[static_cast<size_t>(spec)].shape)) << whole[static_cast<size_t>(spec)].name;
      }
    }
  }
}

ProcessGroupOptions quick_options() {
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  return options;
}

constexpr int64_t kMicro = 2, kSeq = 8;

// Global micro-batch k: its tokens and targets, and the stage's inputs from its neighbours
// (the previous stage's output, the next stage's gradient), each fixed by k.
struct MicroBatch {
  Tensor tokens, targets, input, output_grad;
};

MicroBatch micro_batch(const ModelConfig& m, int k) {
  Rng rng(1000 + static_cast<uint64_t>(k));
  return {testing::random_tokens(kMicro, kSeq, m.vocab_size, 11 + 2 * static_cast<uint64_t>(k)),
          testing::random_tokens(kMicro, kSeq, m.vocab_size, 12 + 2 * static_cast<uint64_t>(k)),
          testing::random_tensor({kMicro * kSeq, m.hidden_size}, rng),
          testing::random_tensor({kMicro * kSeq, m.hidden_size}, rng, 1e-2)};
}

// One micro-batch's forward and backward of `stage` through weights / grads.
LossSum run_stage(DecoderLM& model, const MicroBatch& b, ParamSource& weights, GradSink& grads, float scale) {
  const PipelineStage& stage = model.stage();
  if (!stage.embedding) model.stage_input().copy_from(b.input);
  const LossSum loss = model.stage_forward(b.tokens, b.targets, weights, &grads, scale);
  if (!stage.head) model.stage_output_grad().copy_from(b.output_grad);
  model.stage_backward(b.tokens, weights, grads);
  return loss;
}

double sum_of_squares(const Tensor& t) {
  double s = 0.0;
  for (int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(t.data<float>()[i]) * t.data<float>()[i];
  return s;
}

// `world` ZeRO-1 ranks over `stage`, each running `per_rank` micro-batches, against one
// FlatParameters(stages) rank running all of them.
void expect_sharded_stage_matches_one(const PipelineStage& stage, int world, int per_rank, DType reduce_dtype) {
  SCOPED_TRACE(fmt::format("blocks [{}, {}){}{}, {} ranks x {} micro-batches, reduce {}", stage.first_layer,
                           stage.end_layer, stage.embedding ? " + embedding" : "", stage.head ? " + head" : "", world,
                           per_rank, dtype_name(reduce_dtype)));
  const ModelConfig m = four_layers();
  const int total = world * per_rank;
  const float scale = 1.0f / static_cast<float>(total * kMicro * kSeq);
  std::vector<MicroBatch> batches;
  for (int k = 0; k < total; ++k) batches.push_back(micro_batch(m, k));

  // One rank with the stage's parameters, every micro-batch.
  FlatParameters params(m, Device::CPU, DType::F32, {}, {stage}), grads(m, Device::CPU, DType::F32, {}, {stage});
  params.initialize(5);
  grads.discard();
  DecoderLM one(m, kMicro, kSeq, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr, nullptr, stage);
  LossSum reference;
  for (const MicroBatch& b : batches) {
    const LossSum l = run_stage(one, b, params, grads, scale);
    reference.sum += l.sum;
    reference.tokens += l.tokens;
  }
  // The whole model's initialization and the reference gradients, in the whole model's flat index space.
  FlatParameters whole_init(m);
  whole_init.initialize(5);
  const std::map<std::string, int64_t> offsets = whole_offsets(m);
  std::vector<float> want(static_cast<size_t>(whole_init.flat().numel()), 0.0f);
  for (size_t i = 0; i < grads.specs().size(); ++i)
    std::copy_n(grads.tensors()[i].data<float>(), grads.tensors()[i].numel(),
                want.data() + offsets.at(grads.specs()[i].name));

  std::vector<std::vector<float>> got(static_cast<size_t>(world)), master(static_cast<size_t>(world));
  std::vector<std::vector<FsdpSegment>> segments(static_cast<size_t>(world));
  std::vector<double> norms(static_cast<size_t>(world));
  std::vector<LossSum> losses(static_cast<size_t>(world));
  std::vector<float> gathered;  // gather_to_host of the master weights, on rank 0
  const int port = testing::free_port();
  const auto errors = testing::run_ranks(world, [&](int r) {
    auto group = create_process_group(testing::env_of(r, world, port), quick_options());
    FsdpOptions options;
    options.zero_stage = 1;
    options.reduce_dtype = reduce_dtype;
    options.pipeline_stages = {stage};
    Fsdp fsdp(m, Device::CPU, *group, nullptr, options);
    fsdp.initialize(5);
    DecoderLM model(m, kMicro, kSeq, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr, nullptr,
                    stage);
    // Two steps: the second's gradients must be written over the first's (fresh buffers).
    for (int step = 0; step < 2; ++step) {
      fsdp.begin_step();
      fsdp.begin_micro_batch(false);
      LossSum loss;
      for (int k = 0; k < per_rank; ++k) {
        // Step 0 runs other micro-batches than step 1 (the one checked).
        const MicroBatch& b = step == 0 ? micro_batch(m, 100 + k) : batches[static_cast<size_t>(r * per_rank + k)];
        const LossSum l = run_stage(model, b, fsdp, fsdp, scale);
        loss.sum += l.sum;
        loss.tokens += l.tokens;
      }
      fsdp.reduce_gradients();
      fsdp.finish_gradients();
      losses[static_cast<size_t>(r)] = loss;
    }
    norms[static_cast<size_t>(r)] = fsdp.global_grad_sum_of_squares();
    std::vector<float> flat;
    fsdp.gather_to_host(fsdp.master_segments(), flat);
    if (r == 0) gathered = flat;
    const size_t i = static_cast<size_t>(r);
    segments[i] = fsdp.layout().segments();
    for (size_t s = 0; s < segments[i].size(); ++s) {
      const float* g = fsdp.grad_segments()[s].data<float>();
      const float* w = fsdp.master_segments()[s].data<float>();
      got[i].insert(got[i].end(), g, g + segments[i][s].numel);
      master[i].insert(master[i].end(), w, w + segments[i][s].numel);
    }
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  // Each rank's segments at their flat offsets: every element of the stage once, the
  // gradients the one rank's, the master weights the whole model's initialization.
  const int64_t n = whole_init.flat().numel();
  Tensor assembled = Tensor::zeros({n}), expected = Tensor::zeros({n});
  std::copy(want.begin(), want.end(), expected.data<float>());
  std::vector<int> times(static_cast<size_t>(n), 0);
  for (int r = 0; r < world; ++r) {
    int64_t at = 0;
    for (const FsdpSegment& s : segments[static_cast<size_t>(r)]) {
      for (int64_t e = 0; e < s.numel; ++e) {
        const size_t flat = static_cast<size_t>(s.flat_offset + e);
        ++times[flat];
        assembled.data<float>()[flat] = got[static_cast<size_t>(r)][static_cast<size_t>(at + e)];
        ASSERT_EQ(master[static_cast<size_t>(r)][static_cast<size_t>(at + e)], whole_init.flat().data<float>()[flat])
            << "rank " << r << "'s master weight at flat element " << flat;
      }
      at += s.numel;
    }
  }
  int64_t held = 0;
  for (size_t i = 0; i < grads.specs().size(); ++i) {
    const int64_t begin = offsets.at(grads.specs()[i].name), end = begin + grads.tensors()[i].numel();
    for (int64_t e = begin; e < end; ++e) EXPECT_EQ(times[static_cast<size_t>(e)], 1) << grads.specs()[i].name;
    held += end - begin;
  }
  // gather_to_host: the whole model's flat vector, the stage's initial weights, zero elsewhere.
  ASSERT_EQ(static_cast<int64_t>(gathered.size()), n);
  for (int64_t e = 0; e < n; ++e)
    ASSERT_EQ(gathered[static_cast<size_t>(e)], times[static_cast<size_t>(e)] ? whole_init.flat().data<float>()[e] : 0.0f)
        << "gathered flat element " << e;
  int64_t placed = 0;
  for (int t : times) placed += t;
  EXPECT_EQ(placed, held);  // nothing outside the stage
  const double tolerance = reduce_dtype == DType::F32 ? 1e-5 : 1e-2;
  EXPECT_LT(relative_gap(assembled, expected), tolerance);
  for (size_t i = 0; i < grads.specs().size(); ++i) {  // each parameter on its own scale
    const int64_t begin = offsets.at(grads.specs()[i].name);
    EXPECT_LT(relative_gap(assembled.narrow(begin, begin + grads.tensors()[i].numel()), grads.tensors()[i].view({grads.tensors()[i].numel()})),
              tolerance)
        << grads.specs()[i].name;
  }
  const double reference_norm = sum_of_squares(grads.flat());
  for (int r = 0; r < world; ++r)
    EXPECT_NEAR(norms[static_cast<size_t>(r)], reference_norm, 10 * tolerance * reference_norm) << "rank " << r;
  if (stage.head) {
    LossSum sum;
    for (const LossSum& l : losses) {
      sum.sum += l.sum;
      sum.tokens += l.tokens;
    }
    EXPECT_EQ(sum.tokens, reference.tokens);
    EXPECT_NEAR(sum.sum, reference.sum, 1e-5 * std::abs(reference.sum));
  }
}

TEST(FsdpPipeline, LastStageZero1MatchesOneRank) {
  expect_sharded_stage_matches_one(kLast, 2, 2, DType::F32);
  expect_sharded_stage_matches_one(kLast, 3, 1, DType::F32);
}

TEST(FsdpPipeline, FirstAndMiddleStagesZero1MatchOneRank) {
  expect_sharded_stage_matches_one(kFirst, 2, 2, DType::F32);
  expect_sharded_stage_matches_one(kMiddle, 2, 2, DType::F32);
}

TEST(FsdpPipeline, Bf16ReductionMatchesOneRank) { expect_sharded_stage_matches_one(kLast, 2, 2, DType::BF16); }

// NOTE [FP8 all-gather] over a pipeline rank's stages: the slots hold the stages' blocks
// alone (ZeRO-1: one per held block, 2 of the model's 4 here; ZeRO-3: its three slots capped
// at the 2), and the memory estimate of the 2-stage pipeline agrees up to the padding (its
// fullest rank holds the embedding where this one holds the head, which differ by the
// final norm).
TEST(FsdpPipeline, Fp8AllGatherSlotsHoldTheStagesBlocksAlone) {
  const ModelConfig m = four_layers();
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  const FsdpLayout whole(m, 1, 0);
  const auto pieces = static_cast<int64_t>(fp8_unit_pieces(m, whole.specs(), whole.units().at(1), Fp8Settings{}).size());
  for (int zero : {1, 3}) {
    SCOPED_TRACE(zero);
    FsdpOptions options;
    options.zero_stage = zero;
    options.fp8_all_gather = true;
    options.pipeline_stages = {kLast};
    const int64_t stage = Fsdp(m, Device::CPU, *group, nullptr, options).memory().compute_weights;
    options.pipeline_stages = {};
    const int64_t model = Fsdp(m, Device::CPU, *group, nullptr, options).memory().compute_weights;
    const int64_t slot_statistics = pieces * 4 + 2 * pieces * cpu::kFp8StatStride * 4;  // amax, scales
    MemoryPlan plan;
    plan.fsdp = true;
    plan.zero_stage = zero;
    plan.pipeline_parallel = 2;
    plan.fp8_all_gather = true;
    plan.fp8 = Fp8Settings{};
    const double estimate = estimate_memory(m, plan).compute_weights;
    EXPECT_NEAR(estimate, static_cast<double>(stage - 2 * slot_statistics),
                8.0 * 4 * kFsdpAlign + 4.0 * static_cast<double>(m.hidden_size));
    // Two slots fewer than the whole model's four under ZeRO-1; under ZeRO-3 one fewer than its three.
    const int64_t slot = whole.max_block_numel() + slot_statistics;
    const int64_t embedding = m.vocab_size * m.hidden_size * 4;
    EXPECT_NEAR(static_cast<double>(model - embedding - stage), static_cast<double>((zero == 1 ? 2 : 1) * slot),
                static_cast<double>(2 * slot) * 0.1);
  }
}

TEST(FsdpPipeline, RefusesWhatItDoesNotDo) {
  const ModelConfig m = four_layers();
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  auto options_with = [](auto change) {
    FsdpOptions options;
    options.zero_stage = 1;
    options.pipeline_stages = {kLast};
    change(options);
    return options;
  };
  {
    // NOTE [Frozen FSDP base] over a pipeline rank's stages (LoRA): its units held, nothing reduced.
    Fsdp frozen(m, Device::CPU, *group, nullptr, options_with([](FsdpOptions& o) { o.frozen = true; }));
    frozen.initialize(7);
    frozen.begin_step();
    EXPECT_EQ(frozen.layer(2).params.size(), frozen.layer(3).params.size());
    frozen.output();
    expect_error([&] { frozen.layer(0); }, {"do not hold block 0"});
    frozen.reduce_gradients();
    frozen.finish_gradients();
    expect_error([&] { frozen.layer_grads(2); }, {"frozen base"});
  }
  ModelConfig tied = m;
  tied.tie_word_embeddings = true;
  expect_error([&] { Fsdp(tied, Device::CPU, *group, nullptr, options_with([](FsdpOptions&) {})); },
               {"pipeline_stages", "tie_word_embeddings"});
  // NOTE [ZeRO-2 and -3 under pipeline parallelism]: a tied embedding is reduced once per
  // step, on a last micro-batch the schedule does not mark; ZeRO-1's alone, even on stages
  // that hold both ends.
  for (int stage : {2, 3})
    expect_error([&] {
      Fsdp(tied, Device::CPU, *group, nullptr, options_with([&](FsdpOptions& o) {
             o.zero_stage = stage;
             o.pipeline_stages = {PipelineStage{0, 4, true, true}};
           }));
    },
                 {"pipeline_stages", fmt::format("ZeRO-{}", stage), "tie_word_embeddings", "ZeRO-1 alone"});

  // The units of other stages: their weights and gradients are not there.
  Fsdp fsdp(m, Device::CPU, *group, nullptr, options_with([](FsdpOptions&) {}));
  expect_error([&] { fsdp.embedding(); }, {"embedding", "do not hold the embedding", "blocks [2, 4) + head"});
  expect_error([&] { fsdp.layer(1); }, {"do not hold block 1"});
  expect_error([&] { fsdp.layer_grads(0); }, {"layer_grads", "do not hold block 0"});
  expect_error([&] { fsdp.embedding_grad(); }, {"do not hold the embedding"});
  fsdp.layer(2);
  fsdp.final_norm();
  fsdp.output();

  // The reduction is reduce_gradients()'s, once per step, after every backward.
  fsdp.initialize(3);
  DecoderLM model(m, kMicro, kSeq, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr, nullptr,
                  kLast);
  fsdp.begin_step();
  run_stage(model, micro_batch(m, 0), fsdp, fsdp, 0.1f);
  expect_error([&] { fsdp.finish_gradients(); }, {"never reduced", "reduce_gradients()"});
  fsdp.reduce_gradients();
  fsdp.finish_gradients();
  expect_error([&] { run_stage(model, micro_batch(m, 1), fsdp, fsdp, 0.1f); }, {"after the step's reduce_gradients()"});
}

}  // namespace
}  // namespace forge
