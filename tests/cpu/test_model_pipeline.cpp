// Pipeline parallelism in the model (NOTE [Pipeline parallelism] in model/pipeline.h): P
// ranks (threads of this process over the CPU process group), each running its chunks of
// the decoder through the 1F1B or interleaved schedule over a step's micro-batches, give
// the step's loss one rank gives with the whole model on the last stage's rank, and each
// rank's gradients of its stages' parameters are the whole model's. Fewer and more
// micro-batches than stages, every activation-checkpointing mode, packed examples,
// evaluation's forward through the stages; and the shapes pipelining refuses.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/pipeline_parallel_group.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "model/pipeline.h"
#include "model_testing.h"
#include "expect_error.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::relative_gap;

struct Case {
  PipelineScheduleKind kind;
  int stages, virtual_stages, micro_batches;
  ActivationCheckpoint mode = ActivationCheckpoint::None;
  bool packed = false;
  std::string model = "debug-tiny";
  int layers = 8;
};

// Two examples per row: positions restart at seq/2 + 1, segment ids differ.
SequenceLayout packed_layout(int64_t micro, int64_t seq) {
  SequenceLayout layout{Tensor::empty({micro, seq}, DType::I32), Tensor::empty({micro, seq}, DType::I32)};
  const int64_t cut = seq / 2 + 1;
  for (int64_t b = 0; b < micro; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      layout.positions.data<int32_t>()[b * seq + t] = static_cast<int32_t>(t < cut ? t : t - cut);
      layout.segments.data<int32_t>()[b * seq + t] = t < cut ? 0 : 1;
    }
  return layout;
}

// Whether parameter `spec` belongs to one of `stages`.
bool held(const ParamSpec& spec, const std::vector<PipelineStage>& stages) {
  for (const PipelineStage& s : stages) {
    if (spec.layer >= s.first_layer && spec.layer < s.end_layer) return true;
    if (spec.layer < 0 && s.embedding && spec.name == "embedding.weight") return true;
    if (spec.layer < 0 && s.head && spec.name != "embedding.weight") return true;
  }
  return false;
}

ProcessGroupOptions quick_options() {
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  return options;
}

void expect_stages_match_one(const Case& c) {
  SCOPED_TRACE(fmt::format("{} on {} ranks x {} chunks, {} micro-batches, checkpointing {}{}",
                           pipeline_schedule_name(c.kind), c.stages, c.virtual_stages, c.micro_batches,
                           static_cast<int>(c.mode), c.packed ? ", packed" : ""));
  const ModelConfig m =
      load_experiment("", {{"model.name", c.model}, {"model.num_layers", std::to_string(c.layers)}}).model;
  const int64_t micro = 2, seq = 8;
  std::vector<Tensor> tokens, targets;
  for (int k = 0; k < c.micro_batches; ++k) {
    tokens.push_back(testing::random_tokens(micro, seq, m.vocab_size, 11 + 2 * static_cast<uint64_t>(k)));
    targets.push_back(testing::random_tokens(micro, seq, m.vocab_size, 12 + 2 * static_cast<uint64_t>(k)));
  }
  targets[0].data<int32_t>()[3] = -100;  // a masked position
  const SequenceLayout layout = packed_layout(micro, seq);
  const SequenceLayout* sequences = c.packed ? &layout : nullptr;
  const float scale = 1.0f / static_cast<float>(c.micro_batches * micro * seq);

  FlatParameters params(m), reference_grads(m);
  params.initialize(5);
  DecoderLM one(m, micro, seq, Device::CPU, DType::F32, c.mode);
  LossSum reference;
  for (int k = 0; k < c.micro_batches; ++k) {
    const LossSum l = one.forward_backward(tokens[static_cast<size_t>(k)], targets[static_cast<size_t>(k)], params,
                                           reference_grads, scale, sequences);
    reference.sum += l.sum;
    reference.tokens += l.tokens;
  }
  const LossSum reference_eval = one.forward_loss(tokens[1 % c.micro_batches], targets[1 % c.micro_batches], params,
                                                  sequences);

  std::vector<std::unique_ptr<FlatParameters>> grads;
  for (int r = 0; r < c.stages; ++r) grads.push_back(std::make_unique<FlatParameters>(m));
  std::vector<LossSum> losses(static_cast<size_t>(c.stages)), evals = losses;
  std::vector<std::vector<PipelineStage>> stages(static_cast<size_t>(c.stages));
  const int port = testing::free_port();
  const auto errors = testing::run_ranks(c.stages, [&](int r) {
    auto group = create_process_group(testing::env_of(r, c.stages, port), quick_options());
    GroupPipelineParallel pp(*group);
    PipelineModel model(m, micro, seq, Device::CPU, DType::F32, c.mode, pp, c.kind,
                        {c.stages, c.virtual_stages, c.micro_batches});
    std::vector<PipelineMicroBatch> batches;
    for (int k = 0; k < c.micro_batches; ++k)
      batches.push_back({tokens[static_cast<size_t>(k)], targets[static_cast<size_t>(k)], sequences});
    const size_t i = static_cast<size_t>(r);
    stages[i] = model.stages();
    losses[i] = model.forward_backward(batches, params, *grads[i], scale);
    evals[i] = model.forward_loss(batches[1 % c.micro_batches], params);
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  for (int r = 0; r < c.stages; ++r) {  // the loss is on the last stage's rank
    const LossSum& l = losses[static_cast<size_t>(r)];
    const LossSum& e = evals[static_cast<size_t>(r)];
    if (r == c.stages - 1) {
      EXPECT_EQ(l.tokens, reference.tokens);
      EXPECT_NEAR(l.sum, reference.sum, 1e-5 * std::abs(reference.sum));
      EXPECT_EQ(e.tokens, reference_eval.tokens);
      EXPECT_NEAR(e.sum, reference_eval.sum, 1e-5 * std::abs(reference_eval.sum));
    } else {
      EXPECT_EQ(l.tokens, 0) << "rank " << r;
      EXPECT_EQ(e.tokens, 0) << "rank " << r;
    }
  }
  for (size_t s = 0; s < params.specs().size(); ++s) {
    const ParamSpec& spec = params.specs()[s];
    int holders = 0;
    for (int r = 0; r < c.stages; ++r) {
      const Tensor& g = grads[static_cast<size_t>(r)]->tensors()[s];
      if (held(spec, stages[static_cast<size_t>(r)])) {
        ++holders;
        EXPECT_LT(relative_gap(g, reference_grads.tensors()[s]), 2e-5) << spec.name << "'s gradient on rank " << r;
      } else {
        EXPECT_EQ(relative_gap(g, Tensor::zeros(g.shape())), 0.0) << spec.name << " touched on rank " << r;
      }
    }
    EXPECT_EQ(holders, 1) << spec.name;
  }
}

TEST(ModelPipeline, OneFOneBMatchesOneRank) {
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 3});
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 4, 1, 6});
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 4, 1, 2});  // fewer micro-batches than stages
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 1});
}

TEST(ModelPipeline, InterleavedMatchesOneRank) {
  expect_stages_match_one({PipelineScheduleKind::Interleaved, 2, 2, 4});
  expect_stages_match_one({PipelineScheduleKind::Interleaved, 2, 4, 2});
  expect_stages_match_one({PipelineScheduleKind::Interleaved, 4, 2, 4});
}

TEST(ModelPipeline, CheckpointingModesAndPackedExamples) {
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::Selective, true});
  expect_stages_match_one({PipelineScheduleKind::Interleaved, 2, 2, 2, ActivationCheckpoint::Full});
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 2, ActivationCheckpoint::Full, true,
                           "debug-tiny-mha", 4});
}

TEST(ModelPipeline, StagesCutTheBlocksEvenly) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}, {"model.num_layers", "8"}}).model;
  const PipelineStage first = pipeline_stage(m, 2, 2, 0, 0), last = pipeline_stage(m, 2, 2, 1, 1);
  EXPECT_EQ(first.first_layer, 0);
  EXPECT_EQ(first.end_layer, 2);
  EXPECT_TRUE(first.embedding);
  EXPECT_FALSE(first.head);
  EXPECT_EQ(last.first_layer, 6);
  EXPECT_EQ(last.end_layer, 8);
  EXPECT_TRUE(last.head);
  const PipelineStage middle = pipeline_stage(m, 2, 2, 1, 0);  // virtual stage 1
  EXPECT_EQ(middle.first_layer, 2);
  EXPECT_FALSE(middle.embedding || middle.head);
  // A stage's arena holds its blocks only.
  DecoderLM whole(m, 2, 8), part(m, 2, 8, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr,
                                 nullptr, middle);
  EXPECT_LT(part.arena_bytes(), whole.arena_bytes() / 2);
  EXPECT_EQ(part.arena_bytes(), activation_bytes(m, 2, 8, DType::F32, ActivationCheckpoint::None, 1, 1, 1, middle));
}

TEST(ModelPipeline, RefusesShapesItCannotCut) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}, {"model.num_layers", "6"}}).model;
  expect_error([&] { check_pipeline_parallel(m, 4, 1); }, {"divide"});
  expect_error([&] { check_pipeline_parallel(m, 2, 2); }, {"divide"});
  ModelConfig tied = m;
  tied.tie_word_embeddings = true;
  expect_error([&] { check_pipeline_parallel(tied, 2, 1); }, {"tie_word_embeddings"});
  const ModelConfig moe = load_experiment("", {{"model.name", "debug-tiny-moe"}}).model;
  expect_error([&] { check_pipeline_parallel(moe, 2, 1); }, {"Mixture-of-Experts"});
  check_pipeline_parallel(m, 3, 2);
}

}  // namespace
}  // namespace forge
