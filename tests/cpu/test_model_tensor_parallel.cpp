// Tensor parallelism with sequence parallelism in the model (NOTE [Tensor parallelism] in
// model/tensor_parallel.h): T ranks (threads of this process over the CPU process group),
// each holding its shards of the weights (NOTE [Tensor-parallel shards] in
// model/parameters.h) and reading the same micro-batch, give the loss one rank gives with
// the whole model, and each rank's gradients are its shards of the whole model's. Llama
// (GQA) and MHA shapes, a sliding window, tied embeddings, packed examples, every
// activation-checkpointing mode, 2 and 4 ranks. A shard initialized from a seed is the
// whole parameter's values at the shard's places.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/tensor_parallel_group.h"
#include "model/decoder_lm.h"
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
};

void expect_ranks_match_one(const Case& c) {
  SCOPED_TRACE(fmt::format("{} on {} ranks, checkpointing {}{}{}", c.model, c.ranks, static_cast<int>(c.mode),
                           c.tied ? ", tied embeddings" : "", c.packed ? ", packed" : ""));
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
  const LossSum reference = one.forward_backward(tokens, targets, params, reference_grads, scale, sequences);

  std::vector<std::unique_ptr<FlatParameters>> weights, grads;
  for (int r = 0; r < t; ++r) {
    weights.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{r, c.ranks}));
    weights.back()->initialize(5);
    grads.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{r, c.ranks}));
  }
  std::vector<LossSum> losses(static_cast<size_t>(t));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(c.ranks, [&](int r) {
    auto group = create_process_group(testing::env_of(r, c.ranks, port), options);
    GroupTensorParallel tp(*group);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, c.mode, nullptr, &tp);
    const size_t k = static_cast<size_t>(r);
    losses[k] = model.forward_backward(tokens, targets, *weights[k], *grads[k], scale, sequences);
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  for (int r = 0; r < t; ++r) {  // every rank's loss is every token's
    EXPECT_EQ(losses[static_cast<size_t>(r)].tokens, reference.tokens);
    EXPECT_NEAR(losses[static_cast<size_t>(r)].sum, reference.sum, 1e-5 * std::abs(reference.sum)) << "rank " << r;
  }
  for (size_t s = 0; s < params.specs().size(); ++s) {
    const ParamSpec& spec = params.specs()[s];
    for (int r = 0; r < t; ++r) {
      const TensorParallelShard shard{r, c.ranks};
      EXPECT_EQ(relative_gap(weights[static_cast<size_t>(r)]->tensors()[s], shard_of(params.tensors()[s], spec, shard)),
                0.0)
          << spec.name << "'s initialization on rank " << r;
      EXPECT_LT(relative_gap(grads[static_cast<size_t>(r)]->tensors()[s],
                             shard_of(reference_grads.tensors()[s], spec, shard)),
                2e-5)
          << spec.name << "'s gradient on rank " << r;
    }
  }
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
