// Pipeline parallelism in the model (NOTE [Pipeline parallelism] in model/pipeline.h): P
// ranks (threads of this process over the CPU process group), each running its chunks of
// the decoder through the 1F1B or interleaved schedule over a step's micro-batches, give
// the step's loss one rank gives with the whole model on the last stage's rank, and each
// rank's gradients of its stages' parameters are the whole model's (with tensor-parallel
// stages, 2 x 2 ranks: its shards of them). Fewer and more micro-batches than stages, every
// activation-checkpointing mode, packed examples, evaluation's forward through the stages;
// Multi-head Latent Attention and Mixture-of-Experts blocks (DeepSeek's dense first block
// in a stage of its own or beside MoE ones), whose per-layer, sequence-wise, global and z
// balancing losses the stages' loss sums add up to one rank's (NOTE [Pipeline stages]; the
// global one's counts shared by a stage's micro-batches in flight and started over at each
// step); and the shapes pipelining refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/pipeline_parallel_group.h"
#include "distributed/tensor_parallel_group.h"
#include "model/decoder_lm.h"
#include "model/lora.h"
#include "model/memory_estimate.h"
#include "model/parameters.h"
#include "model/pipeline.h"
#include "model_testing.h"
#include "expect_error.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::packed_layout;
using testing::relative_gap;
using testing::shard_of;

struct Case {
  PipelineScheduleKind kind;
  int stages, virtual_stages, micro_batches;
  ActivationCheckpoint mode = ActivationCheckpoint::None;
  bool packed = false;
  std::string model = "debug-tiny";
  int layers = 8;
  int tensor_parallel = 1;  // T ranks per stage (rank = stage x T + tensor-parallel rank)
  std::vector<std::pair<std::string, std::string>> overrides = {};  // more model.* keys
};

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
  SCOPED_TRACE(fmt::format("{} on {} ranks x {} chunks, {} micro-batches, checkpointing {}{}, tensor-parallel {}",
                           pipeline_schedule_name(c.kind), c.stages, c.virtual_stages, c.micro_batches,
                           static_cast<int>(c.mode), c.packed ? ", packed" : "", c.tensor_parallel));
  std::vector<std::pair<std::string, std::string>> keys = {{"model.name", c.model},
                                                            {"model.num_layers", std::to_string(c.layers)}};
  keys.insert(keys.end(), c.overrides.begin(), c.overrides.end());
  const ModelConfig m = load_experiment("", keys).model;
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

  // Rank r = stage x T + tensor-parallel rank holds its stages' parameters (its shards of them).
  const int t = c.tensor_parallel, ranks = c.stages * t;
  std::vector<std::vector<PipelineStage>> stages(static_cast<size_t>(ranks));
  std::vector<std::unique_ptr<FlatParameters>> weights, grads;
  for (int r = 0; r < ranks; ++r) {
    for (int v = 0; v < c.virtual_stages; ++v)
      stages[static_cast<size_t>(r)].push_back(pipeline_stage(m, c.stages, c.virtual_stages, r / t, v));
    const TensorParallelShard shard{r % t, t};
    weights.push_back(
        std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, shard, stages[static_cast<size_t>(r)]));
    weights.back()->initialize(5);
    grads.push_back(
        std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, shard, stages[static_cast<size_t>(r)]));
  }
  std::vector<LossSum> losses(static_cast<size_t>(ranks)), evals = losses;
  const int port = testing::free_port();
  const auto errors = testing::run_ranks(ranks, [&](int r) {
    auto world = create_process_group(testing::env_of(r, ranks, port), quick_options());
    std::unique_ptr<ProcessGroup> pipeline_group, tensor_group;
    ProcessGroup* pipeline = world.get();
    std::unique_ptr<GroupTensorParallel> tp;
    if (t > 1) {
      pipeline_group = world->split(r % t, r);
      tensor_group = world->split(r / t, r);
      pipeline = pipeline_group.get();
      tp = std::make_unique<GroupTensorParallel>(*tensor_group);
    }
    GroupPipelineParallel pp(*pipeline);
    PipelineModel model(m, micro, seq, Device::CPU, DType::F32, c.mode, pp, c.kind,
                        {c.stages, c.virtual_stages, c.micro_batches}, tp.get());
    std::vector<PipelineMicroBatch> batches;
    for (int k = 0; k < c.micro_batches; ++k)
      batches.push_back({tokens[static_cast<size_t>(k)], targets[static_cast<size_t>(k)], sequences});
    const size_t i = static_cast<size_t>(r);
    EXPECT_EQ(model.stages().size(), stages[i].size());
    losses[i] = model.forward_backward(batches, *weights[i], *grads[i], scale);
    evals[i] = model.forward_loss(batches[1 % c.micro_batches], *weights[i]);
    world->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  // The loss is on the last stage's ranks; the auxiliary losses are each stage's blocks'
  // (NOTE [Pipeline stages]): the sum over one tensor-parallel rank of every stage is one rank's.
  double step_sum = 0;
  for (int r = 0; r < ranks; r += t) step_sum += losses[static_cast<size_t>(r)].sum;
  EXPECT_NEAR(step_sum, reference.sum, 1e-5 * std::abs(reference.sum));
  for (int r = 0; r < ranks; ++r) {
    const LossSum& l = losses[static_cast<size_t>(r)];
    const LossSum& e = evals[static_cast<size_t>(r)];
    if (r / t == c.stages - 1) {
      EXPECT_EQ(l.tokens, reference.tokens);
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
    for (int r = 0; r < ranks; ++r) {
      const FlatParameters& mine = *grads[static_cast<size_t>(r)];
      const auto at = std::find_if(mine.specs().begin(), mine.specs().end(),
                                   [&](const ParamSpec& p) { return p.name == spec.name; });
      EXPECT_EQ(at != mine.specs().end(), held(spec, stages[static_cast<size_t>(r)])) << spec.name << " on rank " << r;
      if (at == mine.specs().end()) continue;
      ++holders;
      const Tensor& g = mine.tensors()[static_cast<size_t>(at - mine.specs().begin())];
      const Tensor expected = shard_of(reference_grads.tensors()[s], spec, {r % t, t});
      EXPECT_LT(relative_gap(g, expected), 2e-5) << spec.name << "'s gradient on rank " << r;
      EXPECT_EQ(relative_gap(weights[static_cast<size_t>(r)]->find(spec.name), shard_of(params.tensors()[s], spec,
                                                                                       {r % t, t})),
                0.0)
          << spec.name << "'s initialization on rank " << r;
    }
    EXPECT_EQ(holders, t) << spec.name;
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

TEST(ModelPipeline, WithTensorParallelStages) {
  Case pp_tp{PipelineScheduleKind::OneFOneB, 2, 1, 3};
  pp_tp.tensor_parallel = 2;
  expect_stages_match_one(pp_tp);
  Case interleaved{PipelineScheduleKind::Interleaved, 2, 2, 2, ActivationCheckpoint::Selective, true};
  interleaved.tensor_parallel = 2;
  expect_stages_match_one(interleaved);
}

TEST(ModelPipeline, LatentAttentionBlocksMatchOneRank) {
  // debug-tiny-mla: MLA blocks, a dense first block, then MoE blocks with a shared expert.
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None, false,
                           "debug-tiny-mla", 4});  // stage 0: the dense block and an MoE one
  expect_stages_match_one({PipelineScheduleKind::Interleaved, 2, 2, 2, ActivationCheckpoint::Selective, true,
                           "debug-tiny-mla", 4});  // stage 0: the dense block alone
  // Stages of 2 blocks over 3 dense ones: stage 1 (blocks 2 and 3, chunk 0 of rank 1) holds the boundary.
  expect_stages_match_one({PipelineScheduleKind::Interleaved, 2, 2, 2, ActivationCheckpoint::Full, false,
                           "debug-tiny-mla", 8, 1, {{"model.first_dense_layers", "3"}}});
}

TEST(ModelPipeline, MixtureOfExpertsBlocksMatchOneRank) {
  expect_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::None, false,
                           "debug-tiny-moe", 4});
  // pooled: the statistics cross the stages with the activations and come back with the
  // gradients (NOTE [Pooled balancing loss across stages]); global: a stage's models of its
  // micro-batches in flight count the step's micro-batches together, so micro-batch k's
  // loss averages micro-batches 0 .. k's counts as one rank's (NOTE [Global balancing loss
  // across stages]; 3 and 4 micro-batches, 2 of them in flight on a chunk at once).
  for (const char* type : {"per_layer", "sequence", "pooled", "global"}) {
    SCOPED_TRACE(type);
    const std::vector<std::pair<std::string, std::string>> losses = {{"model.router_aux_loss_coef", "0.1"},
                                                                      {"model.router_aux_loss_type", type},
                                                                      {"model.router_z_loss_coef", "0.01"}};
    expect_stages_match_one({PipelineScheduleKind::OneFOneB, 2, 1, 3, ActivationCheckpoint::Selective, false,
                             "debug-tiny-moe", 4, 1, losses});
    expect_stages_match_one({PipelineScheduleKind::Interleaved, 2, 2, 4, ActivationCheckpoint::Full, false,
                             "debug-tiny-mla", 4, 1, losses});
  }
}

// NOTE [Global balancing loss across stages]: each forward_backward is a step whose counts
// start over, so a second step on the same weights and micro-batches gives the first's
// losses bit for bit and one rank's (begin_step before each of its steps); counts carried
// over from the first step would change every micro-batch's average.
TEST(ModelPipeline, GlobalBalancingLossStartsOverEachStep) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny-moe"},
                                             {"model.num_layers", "4"},
                                             {"model.router_aux_loss_coef", "0.5"},
                                             {"model.router_aux_loss_type", "global"},
                                             {"model.init_std", "0.3"}})
                            .model;
  const int stages = 2, micro_batches = 3;
  const int64_t micro = 2, seq = 8;
  std::vector<PipelineMicroBatch> batches;
  std::vector<Tensor> tokens;
  for (int k = 0; k < micro_batches; ++k)
    tokens.push_back(testing::random_tokens(micro, seq, m.vocab_size, 40 + static_cast<uint64_t>(k)));
  for (const Tensor& t : tokens) batches.push_back({t, t, nullptr});
  const float scale = 1.0f / static_cast<float>(micro_batches * micro * seq);
  FlatParameters params(m), reference_grads(m);
  params.initialize(7);
  DecoderLM one(m, micro, seq);
  double reference = 0.0;
  for (int step = 0; step < 2; ++step) {
    one.begin_step();
    reference = 0.0;
    for (const Tensor& t : tokens) reference += one.forward_backward(t, t, params, reference_grads, scale).sum;
  }
  std::vector<std::vector<double>> sums(stages);  // per rank, per step
  const int port = testing::free_port();
  const auto errors = testing::run_ranks(stages, [&](int r) {
    auto world = create_process_group(testing::env_of(r, stages, port), quick_options());
    GroupPipelineParallel pp(*world);
    PipelineModel model(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None, pp,
                        PipelineScheduleKind::OneFOneB, {stages, 1, micro_batches});
    const std::vector<PipelineStage> held = model.stages();
    FlatParameters weights(m, Device::CPU, DType::F32, {}, held), grads(m, Device::CPU, DType::F32, {}, held);
    weights.initialize(7);
    for (int step = 0; step < 2; ++step) {
      grads.discard();
      sums[static_cast<size_t>(r)].push_back(model.forward_backward(batches, weights, grads, scale).sum);
    }
    world->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  for (int r = 0; r < stages; ++r) {
    EXPECT_NE(sums[static_cast<size_t>(r)][0], 0.0) << "rank " << r;  // every stage's blocks take the loss
    EXPECT_EQ(sums[static_cast<size_t>(r)][1], sums[static_cast<size_t>(r)][0]) << "rank " << r;
  }
  EXPECT_NEAR(sums[0][1] + sums[1][1], reference, 1e-6 * std::abs(reference));
}

TEST(ModelPipeline, PooledBalancingStatisticsAreOneRanks) {
  // NOTE [Pooled balancing loss across stages]: two stages run by hand, the activations and
  // the statistics copied between them as the exchanges move them. The stages' routings are
  // one rank's bit for bit on the CPU, so the statistics are too: the last stage's loss (the
  // cross-entropy plus the pooled loss, no z-loss here) and every gradient equal one rank's
  // exactly, with and without the dense first block of debug-tiny-mla in the first stage.
  for (const char* name : {"debug-tiny-moe", "debug-tiny-mla"}) {
    SCOPED_TRACE(name);
    const ModelConfig m = load_experiment("", {{"model.name", name},
                                               {"model.num_layers", "4"},
                                               {"model.router_aux_loss_coef", "0.1"},
                                               {"model.router_aux_loss_type", "pooled"}})
                              .model;
    const int64_t micro = 2, seq = 8;
    const Tensor tokens = testing::random_tokens(micro, seq, m.vocab_size, 21);
    const Tensor targets = testing::random_tokens(micro, seq, m.vocab_size, 22);
    const float scale = 1.0f / static_cast<float>(micro * seq);
    FlatParameters params(m), one_grads(m), stage_grads(m);
    params.initialize(5);
    DecoderLM one(m, micro, seq);
    EXPECT_FALSE(one.carries_balance_statistics());
    const LossSum reference = one.forward_backward(tokens, targets, params, one_grads, scale);

    DecoderLM first(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr, nullptr,
                    pipeline_stage(m, 2, 1, 0, 0));
    DecoderLM last(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None, nullptr, nullptr, nullptr,
                   pipeline_stage(m, 2, 1, 1, 0));
    ASSERT_TRUE(first.carries_balance_statistics() && last.carries_balance_statistics());
    const LossSum head_less = first.stage_forward(tokens, targets, params, &stage_grads, scale);
    EXPECT_EQ(head_less.sum, 0.0);  // no z-loss: the first stage's share is nothing
    last.stage_input().copy_from(first.stage_output());
    last.stage_input_statistics().copy_from(first.stage_output_statistics());
    const LossSum loss = last.stage_forward(tokens, targets, params, &stage_grads, scale);
    EXPECT_EQ(loss.sum, reference.sum);
    EXPECT_EQ(loss.tokens, reference.tokens);
    last.stage_backward(tokens, params, stage_grads);
    first.stage_output_grad().copy_from(last.stage_input_grad());
    first.pooled_statistics().copy_from(last.pooled_statistics());
    first.stage_backward(tokens, params, stage_grads);
    for (size_t s = 0; s < params.specs().size(); ++s)
      EXPECT_EQ(relative_gap(stage_grads.tensors()[s], one_grads.tensors()[s]), 0.0) << params.specs()[s].name;
  }
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

TEST(ModelPipeline, MemoryEstimateIsTheFullestRanks) {
  // 1F1B over 2 ranks, 4 micro-batches: rank 0 holds the embedding and 2 micro-batches of
  // its 4 blocks' activations, rank 1 the head and 2 as well (the next micro-batch's input
  // arrives in the round before its backward sends the last one's gradient); the estimate is
  // the larger total.
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}, {"model.num_layers", "8"}}).model;
  MemoryPlan plan;
  plan.micro_batch = 2;
  plan.seq_len = 8;
  plan.micro_batches = 4;
  plan.pipeline_parallel = 2;
  const MemoryEstimate e = estimate_memory(m, plan);
  double worst = 0;
  for (int r = 0; r < 2; ++r) {
    const PipelineStage stage = pipeline_stage(m, 2, 1, r, 0);
    double params = 0;
    for (const ParamSpec& spec : pipeline_stage_specs(parameter_specs(m), {stage}))
      params += static_cast<double>(shape_numel(spec.shape));
    const double activations =
        2.0 *
        static_cast<double>(activation_bytes(m, 2, 8, DType::F32, ActivationCheckpoint::None, 1, 1, 1, stage));
    worst = std::max(worst, params * 16 + activations);  // fp32 master, gradient and two moments
  }
  EXPECT_DOUBLE_EQ(e.total(), worst);
  // LoRA (NOTE [LoRA under pipeline parallelism]): the stages' frozen base, every adapter whole.
  plan.lora.rank = 4;
  plan.lora.target_modules = "all-linear";
  const MemoryEstimate lora = estimate_memory(m, plan);
  const LoraSizes adapters = lora_sizes(m, plan.lora, 2 * 8);
  EXPECT_DOUBLE_EQ(lora.master_weights, static_cast<double>(adapters.stored) * 4);
  EXPECT_DOUBLE_EQ(lora.optimizer_state, static_cast<double>(adapters.stored) * 8);
  double first_stage = 0;
  for (const ParamSpec& spec : pipeline_stage_specs(parameter_specs(m), {pipeline_stage(m, 2, 1, 0, 0)}))
    first_stage += static_cast<double>(shape_numel(spec.shape));
  EXPECT_GE(lora.frozen_weights, first_stage * 4);  // fp32 on the CPU: the fuller stage's
  EXPECT_LT(lora.total(), e.total());
  // Over a stage's 2 data-parallel ranks the frozen base is FSDP's ZeRO-1: the stages in full
  // and the rank's chunk of them (half); QLoRA's NF4 base stays replicated.
  plan.fsdp = true;
  plan.shard_ranks = 2;
  plan.zero_stage = 1;
  EXPECT_DOUBLE_EQ(estimate_memory(m, plan).frozen_weights, lora.frozen_weights * 1.5);
  plan.lora.quantize_base = "nf4";
  const double nf4_alone = [&] {
    MemoryPlan one = plan;
    one.fsdp = false;
    one.shard_ranks = 1;
    return estimate_memory(m, one).frozen_weights;
  }();
  EXPECT_DOUBLE_EQ(estimate_memory(m, plan).frozen_weights, nf4_alone);
  const PipelineSchedule schedule = make_pipeline_schedule(PipelineScheduleKind::OneFOneB, {2, 1, 4});
  EXPECT_EQ(pipeline_chunk_in_flight(schedule, 0, 0), 2);
  EXPECT_EQ(pipeline_chunk_in_flight(schedule, 1, 0), 2);
}

TEST(ModelPipeline, RefusesShapesItCannotCut) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny"}, {"model.num_layers", "6"}}).model;
  expect_error([&] { check_pipeline_parallel(m, 4, 1); }, {"divide"});
  expect_error([&] { check_pipeline_parallel(m, 2, 2); }, {"divide"});
  ModelConfig tied = m;
  tied.tie_word_embeddings = true;
  expect_error([&] { check_pipeline_parallel(tied, 2, 1); }, {"tie_word_embeddings"});
  const ModelConfig moe = load_experiment("", {{"model.name", "debug-tiny-moe"}}).model;
  check_pipeline_parallel(moe, 2, 1);  // NOTE [Pipeline stages]
  ModelConfig pooled = moe;
  pooled.router_aux_loss_coef = 0.01;
  check_pipeline_parallel(pooled, 2, 1);  // NOTE [Pooled balancing loss across stages]
  ModelConfig global = pooled;
  global.router_aux_loss_type = "global";
  check_pipeline_parallel(global, 2, 1);  // NOTE [Global balancing loss across stages]
  check_pipeline_parallel(m, 3, 2);
}

}  // namespace
}  // namespace forge
