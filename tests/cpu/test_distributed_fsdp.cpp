// FSDP in one process: the layout's chunks tile every parameter exactly once at any world
// size, and FSDP over the one-rank group (every stage, every reduce dtype) trains exactly
// as single-device training does: the same losses and the same master weights bit for
// bit with fp32 reduction, within bf16 rounding with bf16 reduction. A frozen Fsdp (NOTE
// [Frozen FSDP base]) holds only its chunk and hands LoRA the base bit for bit. The
// multi-rank runs, through forge launch, are in tests/python/test_fsdp.py and
// tests/python/test_lora_fsdp.py.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/rng.h"
#include "distributed/fsdp.h"
#include "distributed/launch_env.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "optim/optimizer.h"
#include "expect_error.h"

namespace forge {
namespace {

// Three blocks: ZeRO-3's three gather buffers all in use.
ModelConfig tiny(bool tied) { return testing::tiny(tied, 3); }

using testing::random_tokens;

TEST(FsdpLayout, ChunksTileEveryParameterOnceAtAnyWorldSize) {
  for (bool tied : {false, true}) {
    const ModelConfig config = tiny(tied);
    for (int world = 1; world <= 5; ++world) {
      const FsdpLayout first(config, world, 0);
      std::map<int, std::vector<std::pair<int64_t, int64_t>>> covered;  // spec -> [begin, end)
      for (int rank = 0; rank < world; ++rank) {
        const FsdpLayout layout(config, world, rank);
        EXPECT_EQ(layout.shard_numel(), first.shard_numel());
        EXPECT_EQ(layout.num_units(), config.num_layers + 2);  // embedding, blocks, head
        EXPECT_EQ(layout.units()[FsdpLayout::kEmbeddingUnit].params.size(), 1u);
        EXPECT_EQ(layout.units()[static_cast<size_t>(layout.head_unit())].params.size(), tied ? 1u : 2u);
        for (const FsdpUnit& unit : layout.units()) {
          EXPECT_EQ(unit.numel, unit.shard_numel * world);
          EXPECT_EQ(unit.shard_numel % kFsdpAlign, 0);
          for (const FsdpParam& p : unit.params) EXPECT_EQ(p.offset % kFsdpAlign, 0);
        }
        int64_t previous_end = 0;
        for (const FsdpSegment& s : layout.segments()) {
          EXPECT_GE(s.shard_offset, previous_end);  // in shard order, never overlapping
          previous_end = s.shard_offset + s.numel;
          covered[s.spec].push_back({s.param_begin, s.param_begin + s.numel});
          EXPECT_EQ(s.weight_decay, layout.specs()[static_cast<size_t>(s.spec)].weight_decay);
        }
        EXPECT_LE(previous_end, layout.shard_numel());
      }
      ASSERT_EQ(covered.size(), first.specs().size()) << "world " << world;
      for (auto& [spec, ranges] : covered) {
        std::sort(ranges.begin(), ranges.end());
        int64_t next = 0;
        for (auto [begin, end] : ranges) {
          EXPECT_EQ(begin, next) << first.specs()[static_cast<size_t>(spec)].name << " world " << world;
          next = end;
        }
        EXPECT_EQ(next, shape_numel(first.specs()[static_cast<size_t>(spec)].shape));
      }
    }
  }
}

TEST(FsdpLayout, SegmentsPointIntoTheFlatParameterSpace) {
  const ModelConfig config = tiny(false);
  const FsdpLayout layout(config, 3, 1);
  FlatParameters flat(config);
  int64_t offset = 0;
  std::vector<int64_t> offsets;
  for (const Tensor& t : flat.tensors()) {
    offsets.push_back(offset);
    offset += t.numel();
  }
  for (const FsdpSegment& s : layout.segments())
    EXPECT_EQ(s.flat_offset, offsets[static_cast<size_t>(s.spec)] + s.param_begin);
  for (const FsdpUnit& unit : layout.units())
    for (const FsdpParam& p : unit.params) EXPECT_EQ(p.flat_offset, offsets[static_cast<size_t>(p.spec)]);
}

struct TrainedRun {
  std::vector<double> losses;
  std::vector<double> norms;
  std::vector<float> weights;  // flat, parameter_specs order
};

constexpr int kSteps = 3, kAccum = 2, kMicro = 2, kSeq = 16;

TrainedRun train_single(const ModelConfig& config, const OptimizerConfig& opt) {
  FlatParameters params(config), grads(config);
  params.initialize(7);
  std::vector<bool> decay;
  for (const auto& s : params.specs()) decay.push_back(s.weight_decay);
  AdamW adamw(opt, params.tensors(), decay);
  DecoderLM model(config, kMicro, kSeq, Device::CPU, DType::F32, ActivationCheckpoint::None);
  TrainedRun run;
  for (int step = 0; step < kSteps; ++step) {
    grads.zero();
    LossSum loss;
    for (int a = 0; a < kAccum; ++a) {
      const uint64_t seed = 100 * step + a;
      LossSum l = model.forward_backward(random_tokens(kMicro, kSeq, config.vocab_size, seed),
                                         random_tokens(kMicro, kSeq, config.vocab_size, seed + 50), params, grads,
                                         1.0f / (kAccum * kMicro * kSeq));
      loss.sum += l.sum;
      loss.tokens += l.tokens;
    }
    const double norm = global_grad_norm({grads.flat()});
    adamw.step(grads.tensors(), 1e-2, clip_coefficient(norm, 0.5));
    run.losses.push_back(loss.mean());
    run.norms.push_back(norm);
  }
  run.weights.assign(params.flat().data<float>(), params.flat().data<float>() + params.flat().numel());
  return run;
}

TrainedRun train_fsdp(const ModelConfig& config, const OptimizerConfig& opt, const FsdpOptions& options) {
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  Fsdp fsdp(config, Device::CPU, *group, nullptr, options);
  fsdp.initialize(7);
  std::vector<bool> decay;
  for (const FsdpSegment& s : fsdp.layout().segments()) decay.push_back(s.weight_decay);
  AdamW adamw(opt, fsdp.master_segments(), decay);
  DecoderLM model(config, kMicro, kSeq, Device::CPU, DType::F32, ActivationCheckpoint::None);
  TrainedRun run;
  for (int step = 0; step < kSteps; ++step) {
    fsdp.begin_step();
    LossSum loss;
    for (int a = 0; a < kAccum; ++a) {
      const uint64_t seed = 100 * step + a;
      fsdp.begin_micro_batch(a == kAccum - 1);
      LossSum l = model.forward_backward(random_tokens(kMicro, kSeq, config.vocab_size, seed),
                                         random_tokens(kMicro, kSeq, config.vocab_size, seed + 50), fsdp, fsdp,
                                         1.0f / (kAccum * kMicro * kSeq));
      fsdp.end_micro_batch();
      loss.sum += l.sum;
      loss.tokens += l.tokens;
    }
    fsdp.finish_gradients();
    const double norm = std::sqrt(fsdp.global_grad_sum_of_squares());
    adamw.step(fsdp.grad_segments(), 1e-2, clip_coefficient(norm, 0.5));
    fsdp.refresh_compute_weights(false);
    run.losses.push_back(loss.mean());
    run.norms.push_back(norm);
  }
  run.weights.assign(static_cast<size_t>(config.total_params()), 0.0f);
  for (size_t i = 0; i < fsdp.layout().segments().size(); ++i) {
    const FsdpSegment& s = fsdp.layout().segments()[i];
    const float* src = fsdp.master_segments()[i].data<float>();
    std::copy_n(src, s.numel, run.weights.data() + s.flat_offset);
  }
  return run;
}

class FsdpOneRank : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(FsdpOneRank, TrainsAsSingleDeviceTrainingDoes) {
  const auto [stage, tied] = GetParam();
  const ModelConfig config = tiny(tied);
  OptimizerConfig opt;
  const TrainedRun single = train_single(config, opt);
  FsdpOptions options;
  options.zero_stage = stage;
  const TrainedRun fsdp = train_fsdp(config, opt, options);
  // fp32 reduction over one rank is a copy; what differs is only the order of additions
  // (a block's micro-batch gradients are summed in a fresh buffer and then added, the
  // norm's partial sums fall differently around the padding): fp32 rounding.
  for (int i = 0; i < kSteps; ++i) EXPECT_NEAR(fsdp.losses[i], single.losses[i], 1e-6 * single.losses[i]);
  double fp32_diff = 0;
  for (size_t i = 0; i < single.weights.size(); ++i)
    fp32_diff = std::max(fp32_diff, static_cast<double>(std::abs(fsdp.weights[i] - single.weights[i])));
  EXPECT_LT(fp32_diff, 1e-6);

  options.reduce_dtype = DType::BF16;
  const TrainedRun rounded = train_fsdp(config, opt, options);
  // bf16 gradients (8 bits of mantissa): the loss and the norm move by bf16 rounding; the
  // weights' update differs by a few percent of itself (Adam divides by the gradient's
  // size, so elements whose micro-batch gradients nearly cancel move by up to the lr
  // either way when each micro-batch's gradient is rounded, as in ZeRO-2/3).
  for (int i = 0; i < kSteps; ++i) {
    EXPECT_NEAR(rounded.losses[i], single.losses[i], 1e-3 * std::abs(single.losses[i]));
    EXPECT_NEAR(rounded.norms[i], single.norms[i], 3e-2 * single.norms[i]);
  }
  FlatParameters init(config);
  init.initialize(7);
  double diff = 0, update = 0, max_diff = 0;
  for (size_t i = 0; i < single.weights.size(); ++i) {
    const double d = rounded.weights[i] - single.weights[i], u = single.weights[i] - init.flat().data<float>()[i];
    diff += d * d;
    update += u * u;
    max_diff = std::max(max_diff, std::abs(d));
  }
  // ZeRO-2/3 round every micro-batch's gradients of the embedding and the untied head too.
  EXPECT_LT(std::sqrt(diff / update), 0.08);
  EXPECT_GT(max_diff, 0.0);  // it did round
}

INSTANTIATE_TEST_SUITE_P(Stages, FsdpOneRank,
                         ::testing::Combine(::testing::Values(1, 2, 3), ::testing::Values(false, true)));

TEST(FsdpInit, AnyHostWindowGivesTheSameMasterChunk) {
  const ModelConfig config = tiny(false);
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  FsdpOptions whole, pieces;
  pieces.host_window = 37;  // windows that cut segments anywhere
  Fsdp a(config, Device::CPU, *group, nullptr, whole), b(config, Device::CPU, *group, nullptr, pieces);
  a.initialize(11);
  b.initialize(11);
  const Tensor& x = a.master_shard();
  const Tensor& y = b.master_shard();
  ASSERT_EQ(x.numel(), y.numel());
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(x.data<float>()[i], y.data<float>()[i]) << i;
  FlatParameters flat(config);
  flat.initialize(11);
  for (size_t i = 0; i < a.layout().segments().size(); ++i) {
    const FsdpSegment& s = a.layout().segments()[i];
    for (int64_t k = 0; k < s.numel; ++k)
      ASSERT_EQ(x.data<float>()[s.shard_offset + k], flat.flat().data<float>()[s.flat_offset + k]);
  }
  // load_master through small windows reads the flat vector back.
  b.load_master([&](int64_t offset, std::span<float> out) {
    std::copy_n(flat.flat().data<float>() + offset, out.size(), out.data());
  });
  for (int64_t i = 0; i < x.numel(); ++i) ASSERT_EQ(x.data<float>()[i], y.data<float>()[i]) << i;
}

TEST(FsdpMemory, FollowsTheStage) {
  for (bool tied : {false, true}) {
    const ModelConfig config = tiny(tied);
    auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
    std::vector<FsdpMemory> m;
    for (int stage = 1; stage <= 3; ++stage) {
      FsdpOptions options;
      options.zero_stage = stage;
      m.push_back(Fsdp(config, Device::CPU, *group, nullptr, options).memory());
    }
    const FsdpLayout layout(config, 1, 0);
    const int64_t embedding = layout.units()[FsdpLayout::kEmbeddingUnit].numel;
    const int64_t head = layout.units()[static_cast<size_t>(layout.head_unit())].numel;
    for (const FsdpMemory& each : m) EXPECT_EQ(each.master_weights, layout.shard_numel() * 4);
    EXPECT_EQ(m[0].full_gradients, layout.full_numel() * 4);  // ZeRO-1 keeps every gradient
    // ZeRO-2/3: two slots as large as the largest unit that goes through them, plus the
    // tied embedding's own buffer.
    const int64_t slot = tied ? std::max(layout.max_block_numel(), head) : layout.max_unit_numel();
    for (int stage : {1, 2}) EXPECT_EQ(m[stage].full_gradients, (2 * slot + (tied ? embedding : 0)) * 4);
    EXPECT_EQ(m[1].compute_weights, layout.full_numel() * 4);  // fp32 compute on the CPU
    // ZeRO-3: the embedding and head in full and three gathered blocks, no copy of the chunk.
    EXPECT_EQ(m[2].compute_weights, (embedding + head + 3 * layout.max_block_numel()) * 4);
    for (const FsdpMemory& each : m) EXPECT_EQ(each.reduce_buffers, 0);  // fp32: made on first use
  }
}

// NOTE [Frozen FSDP base]: the chunk in the compute dtype (fp32 on the CPU) and what the
// stage holds in full; no master, no gradient, no reduction buffer.
TEST(FsdpFrozen, HoldsItsChunkAndNothingTrainable) {
  const ModelConfig config = tiny(false);
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  const FsdpLayout layout(config, 1, 0);
  const int64_t embedding = layout.units()[FsdpLayout::kEmbeddingUnit].numel;
  const int64_t head = layout.units()[static_cast<size_t>(layout.head_unit())].numel;
  for (int stage : {1, 3}) {
    FsdpOptions options;
    options.zero_stage = stage;
    options.frozen = true;
    Fsdp fsdp(config, Device::CPU, *group, nullptr, options);
    const FsdpMemory m = fsdp.memory();
    EXPECT_EQ(m.master_weights, 0);
    EXPECT_EQ(m.gradient_shard, 0);
    EXPECT_EQ(m.full_gradients, 0);
    EXPECT_EQ(m.reduce_buffers, 0);
    const int64_t held = stage == 3 ? embedding + head + 3 * layout.max_block_numel() : layout.full_numel();
    EXPECT_EQ(m.compute_weights, (layout.shard_numel() + held) * 4);
    EXPECT_TRUE(fsdp.grad_segments().empty());
    expect_error([&] { fsdp.layer_grads(0); }, {"frozen base", "no gradients"});
    expect_error([&] { fsdp.global_grad_sum_of_squares(); }, {"frozen base"});
  }
}

// LoRA over a frozen Fsdp computes bit for bit what it computes over the whole base, in
// every stage and with activation checkpointing (one rank: the gathers are copies).
TEST(FsdpFrozen, LoraOverTheFrozenBaseMatchesTheWholeBase) {
  const ModelConfig config = tiny(false);
  LoraConfig c;
  c.rank = 3;
  c.alpha = 6.0;
  c.target_modules = "all-linear";
  c.dropout = 0.1;
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  const Tensor tokens = random_tokens(kMicro, kSeq, config.vocab_size, 3);
  const Tensor targets = random_tokens(kMicro, kSeq, config.vocab_size, 4);
  auto gradients = [&](ParamSource& base) {
    LoraAdapters adapters(config, c, Device::CPU, kMicro * kSeq);
    adapters.initialize(2);
    testing::set_nonzero_lora_b(adapters);
    adapters.set_base(base);
    adapters.set_dropout_step(9, 0);
    DecoderLM model(config, kMicro, kSeq, Device::CPU, DType::F32, ActivationCheckpoint::Full);
    adapters.discard();
    const LossSum loss = model.forward_backward(tokens, targets, adapters, adapters, 1.0f / (kMicro * kSeq));
    return std::make_pair(loss.sum, adapters.gradient_flat().clone());
  };
  FlatParameters whole(config);
  whole.initialize(7);
  const auto expected = gradients(whole);
  for (int stage : {1, 2, 3}) {
    SCOPED_TRACE(stage);
    FsdpOptions options;
    options.zero_stage = stage;
    options.frozen = true;
    Fsdp fsdp(config, Device::CPU, *group, nullptr, options);
    fsdp.initialize(7);
    const auto got = gradients(fsdp);
    EXPECT_EQ(got.first, expected.first);
    EXPECT_TRUE(testing::bitwise_equal(got.second, expected.second));
  }
}

}  // namespace
}  // namespace forge
