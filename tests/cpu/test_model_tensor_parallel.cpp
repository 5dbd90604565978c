// Tensor parallelism with sequence parallelism in the model (NOTE [Tensor parallelism] in
// model/tensor_parallel.h): T ranks (threads of this process over the CPU process group),
// each holding its shards of the weights (NOTE [Tensor-parallel shards] in
// model/parameters.h) and reading the same micro-batch, give the loss one rank gives with
// the whole model, and each rank's gradients are its shards of the whole model's. Llama
// (GQA) and MHA shapes, a sliding window, tied embeddings, packed examples, every
// activation-checkpointing mode, 2 and 4 ranks. A shard initialized from a seed is the
// whole parameter's values at the shard's places.
// In FP8 (NOTE [FP8 under tensor parallelism] in model/fp8_projections.h), tensorwise and
// delayed, with and without the FP8 head: every amax of a sharded tensor is max-reduced over
// the group, so each rank quantizes with the scales one rank's whole tensors get, the codes
// are one rank's, and the loss and gradients follow one rank's FP8 step within fp32
// reordering, the bounds of the fp32 runs: measured loss gaps at most 9.1e-9 relative,
// gradients 3.6e-7 of their scale (without the agreement, each rank scaling its shards by
// their own amax: 7.3e-4 and 0.25). The step's amaxes max-reduced over the ranks are one
// rank's (the weights' exactly, x's and dy's within 1e-5), and a delayed run's histories
// and scales are the same on every rank, bit for bit.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <optional>

#include "cli/config.h"
#include "distributed/tensor_parallel_group.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/parameters.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::packed_layout;
using testing::relative_gap;
using testing::shard_of;

struct Case {
  std::string model;
  int ranks;
  ActivationCheckpoint mode = ActivationCheckpoint::None;
  bool tied = false;
  bool packed = false;  // two examples per row (NOTE [Packed examples])
  std::optional<Fp8Recipe> fp8;  // NOTE [FP8 under tensor parallelism]; delayed runs a first step to set its scales
  bool fp8_head = false;         // precision.fp8_output_head
};

void expect_ranks_match_one(const Case& c) {
  SCOPED_TRACE(fmt::format("{} on {} ranks, checkpointing {}{}{}{}{}", c.model, c.ranks, static_cast<int>(c.mode),
                           c.tied ? ", tied embeddings" : "", c.packed ? ", packed" : "",
                           !c.fp8 ? "" : *c.fp8 == Fp8Recipe::Delayed ? ", FP8 delayed" : ", FP8 tensorwise",
                           c.fp8_head ? " with the head" : ""));
  ConfigOverrides overrides = {{"model.name", c.model}};
  if (c.tied) overrides.push_back({"model.tie_word_embeddings", "true"});
  const ModelConfig m = load_experiment("", overrides).model;
  const int64_t micro = 2, seq = 8, t = c.ranks;
  const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 11);
  Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 12);
  targets.data<int32_t>()[3] = -100;  // a masked position
  const SequenceLayout layout = packed_layout(micro, seq);
  const SequenceLayout* sequences = c.packed ? &layout : nullptr;
  const float scale = 1.0f / static_cast<float>(micro * seq);

  FlatParameters params(m), reference_grads(m);
  params.initialize(5);
  DecoderLM one(m, micro, seq, Device::CPU, DType::F32, c.mode);
  Fp8Settings settings;
  if (c.fp8) {
    settings.recipe = *c.fp8;
    settings.amax_history_length = 4;
    settings.output_head = c.fp8_head;
  }
  // A delayed run's second step quantizes with the scales its first step's amaxes gave.
  const int steps = c.fp8 == Fp8Recipe::Delayed ? 2 : 1;
  Fp8Projections one_fp8(m, settings, Device::CPU, micro * seq);
  one_fp8.set_base(params, reference_grads);
  ParamSource& one_weights = c.fp8 ? static_cast<ParamSource&>(one_fp8) : params;
  GradSink& one_grads = c.fp8 ? static_cast<GradSink&>(one_fp8) : reference_grads;
  LossSum reference;
  for (int step = 0; step < steps; ++step) {
    reference = one.forward_backward(tokens, targets, one_weights, one_grads, scale, sequences);
    if (step + 1 < steps) one_fp8.end_step(true);
  }

  std::vector<std::unique_ptr<FlatParameters>> weights, grads;
  for (int r = 0; r < t; ++r) {
    weights.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{r, c.ranks}));
    weights.back()->initialize(5);
    grads.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{r, c.ranks}));
  }
  std::vector<LossSum> losses(static_cast<size_t>(t));
  std::vector<Tensor> statistics(static_cast<size_t>(t));  // FP8: each rank's, max-reduced over the group
  std::vector<Fp8DelayedState> delayed(static_cast<size_t>(t));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(c.ranks, [&](int r) {
    auto group = create_process_group(testing::env_of(r, c.ranks, port), options);
    GroupTensorParallel tp(*group);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, c.mode, nullptr, &tp);
    const size_t k = static_cast<size_t>(r);
    Fp8Projections fp8(m, settings, Device::CPU, micro * seq);
    fp8.set_base(*weights[k], *grads[k]);
    fp8.set_tensor_parallel_group(tp);
    ParamSource& rank_weights = c.fp8 ? static_cast<ParamSource&>(fp8) : *weights[k];
    GradSink& rank_grads = c.fp8 ? static_cast<GradSink&>(fp8) : *grads[k];
    for (int step = 0; step < steps; ++step) {
      losses[k] = model.forward_backward(tokens, targets, rank_weights, rank_grads, scale, sequences);
      if (c.fp8) tp.all_reduce_max(fp8.statistics());  // as the trainer's step end (NOTE [FP8 under tensor parallelism])
      if (step + 1 < steps) fp8.end_step(true);
    }
    statistics[k] = fp8.statistics().clone();
    delayed[k] = fp8.delayed_state();
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  double loss_gap = 0.0, gradient_gap = 0.0;
  for (int r = 0; r < t; ++r) {  // every rank's loss is every token's
    EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, reference.tokens);
    EXPECT_NEAR(losses[static_cast<size_t>(r)].sum, reference.sum, 1e-5 * std::abs(reference.sum)) << "rank " << r;
    loss_gap = std::max(loss_gap, std::abs(losses[static_cast<size_t>(r)].sum - reference.sum) / std::abs(reference.sum));
  }
  for (size_t s = 0; s < params.specs().size(); ++s) {
    const ParamSpec& spec = params.specs()[s];
    for (int r = 0; r < t; ++r) {
      const TensorParallelShard shard{r, c.ranks};
      EXPECT_EQ(relative_gap(weights[static_cast<size_t>(r)]->tensors()[s], shard_of(params.tensors()[s], spec, shard)),
                0.0)
          << spec.name << "'s initialization on rank " << r;
      const double gap =
          relative_gap(grads[static_cast<size_t>(r)]->tensors()[s], shard_of(reference_grads.tensors()[s], spec, shard));
      gradient_gap = std::max(gradient_gap, gap);
      EXPECT_LT(gap, 2e-5) << spec.name << "'s gradient on rank " << r;
    }
  }
  if (!c.fp8) return;
  std::printf("FP8 under tensor parallelism: loss gap %.3g, largest gradient gap %.3g\n", loss_gap, gradient_gap);
  // The step's amaxes, max-reduced over the group, are one rank's: the same on every rank.
  const Tensor& want = one_fp8.statistics();
  for (int64_t p = 0; p < fp8_projection_count(m, settings); ++p)
    for (int role_index = 0; role_index < cpu::kFp8Roles; ++role_index) {
      const auto role = static_cast<cpu::Fp8Role>(role_index);
      const float expected = want.data<float>()[cpu::fp8_seen_offset(p, role)];
      for (int r = 0; r < t; ++r) {
        const Tensor& got = statistics[static_cast<size_t>(r)];
        EXPECT_EQ(got.data<float>()[cpu::fp8_seen_offset(p, role)],
                  statistics[0].data<float>()[cpu::fp8_seen_offset(p, role)]);
        EXPECT_EQ(got.data<float>()[cpu::fp8_scale_offset(p, role)],
                  statistics[0].data<float>()[cpu::fp8_scale_offset(p, role)]);
      }
      EXPECT_GT(expected, 0.0f);
      // A weight's amax is one rank's bit for bit (the maximum over its shards); x's and dy's
      // follow the activations' fp32 reordering, and so do a delayed run's scales from them.
      const float got = statistics[0].data<float>()[cpu::fp8_seen_offset(p, role)];
      const float scale = statistics[0].data<float>()[cpu::fp8_scale_offset(p, role)];
      const float want_scale = want.data<float>()[cpu::fp8_scale_offset(p, role)];
      if (role == cpu::Fp8Role::W) {
        EXPECT_EQ(got, expected) << "projection " << p;
        EXPECT_EQ(scale, want_scale) << "projection " << p;
      } else {
        EXPECT_NEAR(got, expected, 1e-5 * expected) << "projection " << p << " " << cpu::fp8_role_name(role);
        EXPECT_NEAR(scale, want_scale, 1e-5 * want_scale) << "projection " << p << " " << cpu::fp8_role_name(role);
      }
    }
  for (int r = 1; r < t; ++r) {  // delayed: the same histories and scales everywhere
    EXPECT_EQ(delayed[static_cast<size_t>(r)].histories, delayed[0].histories);
    EXPECT_EQ(delayed[static_cast<size_t>(r)].scales, delayed[0].scales);
  }
  if (c.fp8 == Fp8Recipe::Delayed) EXPECT_TRUE(delayed[0].active);
}

TEST(ModelTensorParallel, TwoRanksMatchOneInEveryCheckpointingMode) {
  for (ActivationCheckpoint mode :
       {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny", 2, mode});
}

TEST(ModelTensorParallel, FourRanksMhaTiedAndPacked) {
  expect_ranks_match_one({"debug-tiny-mha", 4, ActivationCheckpoint::None});
  expect_ranks_match_one({"debug-tiny-mha", 4, ActivationCheckpoint::Full, true});
  expect_ranks_match_one({"debug-tiny", 2, ActivationCheckpoint::Selective, true, true});
  expect_ranks_match_one({"debug-tiny-swa", 2, ActivationCheckpoint::None, false, true});
}

TEST(ModelTensorParallel, Fp8RanksMatchOneFp8Rank) {
  for (Fp8Recipe recipe : {Fp8Recipe::Tensorwise, Fp8Recipe::Delayed}) {
    Case c{"debug-tiny", 2, ActivationCheckpoint::None};
    c.fp8 = recipe;
    expect_ranks_match_one(c);
    c.mode = ActivationCheckpoint::Selective;
    c.fp8_head = true;
    expect_ranks_match_one(c);
    c = {"debug-tiny-mha", 4, ActivationCheckpoint::Full, true};
    c.fp8 = recipe;
    expect_ranks_match_one(c);
  }
}

TEST(ModelTensorParallel, ShardSpecsSplitHeadsColumnsAndVocabulary) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}}).model;  // 4 heads, 2 KV heads, D 16
  const std::vector<ParamSpec> whole = parameter_specs(m), shard = parameter_specs(m, {1, 2});
  ASSERT_EQ(whole.size(), shard.size());
  auto find = [&](const std::vector<ParamSpec>& specs, const std::string& name) {
    for (const ParamSpec& s : specs)
      if (s.name == name) return s;
    ADD_FAILURE() << name;
    return ParamSpec{};
  };
  EXPECT_EQ(find(shard, "layers.0.attention.qkv.weight").shape, (Shape{(2 + 2) * 16, 64}));
  EXPECT_EQ(find(shard, "layers.0.attention.o.weight").shape, (Shape{64, 32}));
  EXPECT_EQ(find(shard, "layers.1.mlp.gate_up.weight").shape, (Shape{192, 64}));
  EXPECT_EQ(find(shard, "layers.1.mlp.down.weight").shape, (Shape{64, 96}));
  EXPECT_EQ(find(shard, "embedding.weight").shape, (Shape{16, 64}));
  EXPECT_EQ(find(shard, "final_norm.weight").shape, (Shape{64}));
  // Rank 1's qkv rows: its query heads (rows 32-63 of q), then its key and value head.
  const std::vector<ShardRun> runs = tensor_parallel_runs(find(whole, "layers.0.attention.qkv.weight"), {1, 2});
  ASSERT_EQ(runs.size(), 3u);
  EXPECT_EQ(runs[0].full_begin, 32 * 64);
  EXPECT_EQ(runs[1].full_begin, (64 + 16) * 64);
  EXPECT_EQ(runs[2].full_begin, (64 + 32 + 16) * 64);
  EXPECT_EQ(runs[2].local_begin, (32 + 16) * 64);
  // Columns: one run per row.
  EXPECT_EQ(tensor_parallel_runs(find(whole, "layers.0.attention.o.weight"), {1, 2}).size(), 64u);
}

TEST(ModelTensorParallel, DegreesThatDoNotDivideAreErrors) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}}).model;  // 2 KV heads
  try {
    parameter_specs(m, {0, 4});
    FAIL() << "4 ranks over 2 key/value heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.num_kv_heads"), std::string::npos) << e.what();
  }
  try {
    parameter_specs(m, {0, 3});
    FAIL() << "3 ranks over 4 heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("model.num_heads"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge
