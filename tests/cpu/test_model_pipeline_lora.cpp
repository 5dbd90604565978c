// LoRA under pipeline parallelism in the model (NOTE [LoRA under pipeline parallelism] in
// model/lora.h): P ranks (threads of this process over the CPU process group), each holding
// its stages' frozen base (fp32, or NF4 under QLoRA) and every adapter whole, run a step's
// micro-batches through the 1F1B or interleaved schedule with each micro-batch's dropout
// masks set before its forwards and backwards; after zero_unwritten_gradients the sum of the
// ranks' adapter gradients is one rank's over the whole model, and each rank wrote only its
// stages' adapters. merge_into merges a rank's stages' adapters into its stages' parameters.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/pipeline_parallel_group.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/nf4_base.h"
#include "model/parameters.h"
#include "model/pipeline.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;

struct LoraCase {
  PipelineScheduleKind kind;
  int stages, virtual_stages, micro_batches;
  double dropout = 0.0;
  bool nf4 = false;
};

// The frozen base of `stages` (every parameter for none), seeded as one rank's.
std::unique_ptr<ParamSource> frozen_base(const ModelConfig& m, const std::vector<PipelineStage>& stages, bool nf4,
                                         std::unique_ptr<FlatParameters>& flat) {
  if (nf4) {
    auto base = std::make_unique<Nf4FrozenBase>(m, Device::CPU, DType::F32, stages);
    base->initialize(5);
    return base;
  }
  flat = std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{}, stages);
  flat->initialize(5);
  return nullptr;
}

void expect_lora_stages_match_one(const LoraCase& c) {
  SCOPED_TRACE(fmt::format("{} on {} ranks x {} chunks, {} micro-batches, dropout {}{}",
                           pipeline_schedule_name(c.kind), c.stages, c.virtual_stages, c.micro_batches, c.dropout,
                           c.nf4 ? ", NF4 base" : ""));
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}, {"model.num_layers", "8"}}).model;
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.dropout = c.dropout;
  lora.target_modules = "all-linear";
  const int64_t micro = 2, seq = 8;
  std::vector<Tensor> tokens, targets;
  for (int k = 0; k < c.micro_batches; ++k) {
    tokens.push_back(testing::random_tokens(micro, seq, m.vocab_size, 31 + 2 * static_cast<uint64_t>(k)));
    targets.push_back(testing::random_tokens(micro, seq, m.vocab_size, 32 + 2 * static_cast<uint64_t>(k)));
  }
  const float scale = 1.0f / static_cast<float>(c.micro_batches * micro * seq);
  const uint64_t dropout_seed = 77;

  // One rank: the whole base, the adapters with B moved off zero so that every gradient is nonzero.
  auto adapters = [&] {
    auto a = std::make_unique<LoraAdapters>(m, lora, Device::CPU, micro * seq);
    a->initialize(9);
    for (size_t k = 1; k < a->masters().size(); k += 2) {
      const Tensor& b = a->masters()[k];
      for (int64_t j = 0; j < b.numel(); ++j) b.data<float>()[j] = 0.01f * static_cast<float>((j * 7) % 13 - 6);
    }
    a->refresh_compute();
    return a;
  };
  std::unique_ptr<FlatParameters> whole_flat;
  std::unique_ptr<ParamSource> whole_nf4 = frozen_base(m, {}, c.nf4, whole_flat);
  auto one = adapters();
  one->set_base(whole_nf4 ? *whole_nf4 : *whole_flat);
  one->discard();
  DecoderLM decoder(m, micro, seq);
  LossSum reference;
  for (int k = 0; k < c.micro_batches; ++k) {
    one->set_dropout_step(dropout_seed, static_cast<uint64_t>(k));
    const LossSum l = decoder.forward_backward(tokens[static_cast<size_t>(k)], targets[static_cast<size_t>(k)], *one,
                                               *one, scale);
    reference.sum += l.sum;
    reference.tokens += l.tokens;
  }

  const int ranks = c.stages;
  std::vector<std::vector<PipelineStage>> stages(static_cast<size_t>(ranks));
  std::vector<std::unique_ptr<FlatParameters>> flats(static_cast<size_t>(ranks));
  std::vector<std::unique_ptr<ParamSource>> nf4s(static_cast<size_t>(ranks));
  std::vector<std::unique_ptr<LoraAdapters>> mine(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const size_t i = static_cast<size_t>(r);
    for (int v = 0; v < c.virtual_stages; ++v) stages[i].push_back(pipeline_stage(m, c.stages, c.virtual_stages, r, v));
    nf4s[i] = frozen_base(m, stages[i], c.nf4, flats[i]);
    mine[i] = adapters();
    mine[i]->set_base(nf4s[i] ? *nf4s[i] : *flats[i]);
    // Stale values from an earlier step: zero_unwritten_gradients must clear the other stages'.
    for (const Tensor& g : mine[i]->gradients())
      for (int64_t j = 0; j < g.numel(); ++j) g.data<float>()[j] = 1.0f;
    mine[i]->discard();
  }
  std::vector<LossSum> losses(static_cast<size_t>(ranks));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(ranks, [&](int r) {
    const size_t i = static_cast<size_t>(r);
    auto world = create_process_group(testing::env_of(r, ranks, port), options);
    GroupPipelineParallel pp(*world);
    PipelineModel model(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::Selective, pp, c.kind,
                        {c.stages, c.virtual_stages, c.micro_batches});
    std::vector<PipelineMicroBatch> batches;
    for (int k = 0; k < c.micro_batches; ++k)
      batches.push_back({tokens[static_cast<size_t>(k)], targets[static_cast<size_t>(k)], nullptr});
    losses[i] = model.forward_backward(batches, *mine[i], *mine[i], scale, [&](int k) {
      mine[i]->set_dropout_step(dropout_seed, static_cast<uint64_t>(k));
    });
    mine[i]->zero_unwritten_gradients();
    world->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  EXPECT_EQ(losses.back().tokens, reference.tokens);
  EXPECT_NEAR(losses.back().sum, reference.sum, 1e-5 * std::abs(reference.sum));
  const std::vector<LoraTarget>& targets_of = one->targets();
  for (size_t k = 0; k < one->gradients().size(); ++k) {
    const int layer = targets_of[k / 2].layer;
    Tensor sum = Tensor::zeros(one->gradients()[k].shape());
    for (int r = 0; r < ranks; ++r) {
      const Tensor& g = mine[static_cast<size_t>(r)]->gradients()[k];
      bool owns = false;
      for (const PipelineStage& s : stages[static_cast<size_t>(r)]) owns |= layer >= s.first_layer && layer < s.end_layer;
      if (!owns) EXPECT_EQ(relative_gap(g, Tensor::zeros(g.shape())), 0.0) << k << " on rank " << r;
      for (int64_t j = 0; j < g.numel(); ++j) sum.data<float>()[j] += g.data<float>()[j];
    }
    EXPECT_GT(relative_gap(one->gradients()[k], Tensor::zeros(sum.shape())), 0.0) << "gradient " << k << " is zero";
    EXPECT_LT(relative_gap(sum, one->gradients()[k]), 2e-5) << one->master_names()[k];
  }
  if (c.nf4) return;
  // The merged export's pieces: a rank's stages' weights with its stages' adapters, as one rank's.
  FlatParameters whole_merged(m);
  whole_merged.assign_from(*whole_flat);
  one->merge_into(whole_merged);
  for (int r = 0; r < ranks; ++r) {
    FlatParameters merged(m, Device::CPU, DType::F32, TensorParallelShard{}, stages[static_cast<size_t>(r)]);
    merged.assign_from(*flats[static_cast<size_t>(r)]);
    mine[static_cast<size_t>(r)]->merge_into(merged);
    for (size_t s = 0; s < merged.specs().size(); ++s)
      EXPECT_EQ(relative_gap(merged.tensors()[s], whole_merged.find(merged.specs()[s].name)), 0.0)
          << merged.specs()[s].name << " on rank " << r;
  }
}

TEST(ModelPipelineLora, OneFOneBMatchesOneRank) {
  expect_lora_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 3});
  expect_lora_stages_match_one({PipelineScheduleKind::OneFOneB, 4, 1, 4, 0.1});
}

TEST(ModelPipelineLora, InterleavedMatchesOneRank) {
  expect_lora_stages_match_one({PipelineScheduleKind::Interleaved, 2, 2, 4, 0.1});
}

TEST(ModelPipelineLora, Nf4BaseOfTheStagesMatchesOneRank) {
  expect_lora_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 2, 0.0, true});
  expect_lora_stages_match_one({PipelineScheduleKind::Interleaved, 2, 2, 2, 0.1, true});
}

}  // namespace
}  // namespace forge
