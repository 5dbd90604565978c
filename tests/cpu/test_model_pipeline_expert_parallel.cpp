// Expert parallelism under pipeline parallelism in the model (NOTE [Expert parallelism under
// pipeline parallelism] in model/pipeline.h): 2 pipeline ranks x 2 expert-parallel ranks
// (threads of this process over the CPU process group, rank = stage x 2 + expert-parallel
// rank), each holding its stages' parameters with its local experts' slices of the expert
// stacks and running its own micro-batches through the schedule, every stage's MoE blocks
// dispatching over the stage's group, give the step's loss and gradients one rank gives on
// all their micro-batches: the non-expert gradients summed over a stage's two ranks, each
// rank's experts' gradients its slice of the whole, the loads summed over the four ranks
// the whole model's. Mixtral-style and DeepSeek-shaped (MLA, a dense first block in a stage
// of its own or beside MoE ones, shared experts) models with their balancing losses (the
// global one's counts summed over the stage's ranks: against one rank on the ranks' k-th
// micro-batches together), 1F1B
// and the interleaved schedule, every activation-checkpointing mode (full checkpointing
// recomputes the forwards, which dispatch again). Whole runs: tests/python/
// test_pipeline_expert_parallel.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "cli/config.h"
#include "distributed/data_parallel_comm.h"
#include "distributed/expert_dispatch_group.h"
#include "distributed/pipeline_parallel_group.h"
#include "model/parameters.h"
#include "model/pipeline.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::LocalExperts;
using testing::relative_gap;

constexpr int kExpertParallel = 2;

ProcessGroupOptions quick_options() {
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  return options;
}

struct Case {
  std::string model;
  PipelineScheduleKind kind;
  int virtual_stages, micro_batches;  // micro-batches per expert-parallel rank
  ActivationCheckpoint mode;
  ConfigOverrides overrides = {};
  // Megatron's global balancing loss (NOTE [Global balancing loss across stages]): each
  // micro-batch's counts summed over the stage's expert-parallel (data-parallel) ranks. The
  // ranks' k-th micro-batches are then one rank's k-th micro-batch of their rows together,
  // whose loss is the sum of theirs; the reference takes those at 1 / P of the coefficient
  // (each rank's micro-batch weighs 1 / P of the union's in the step).
  bool global_loss = false;
};

void expect_ranks_match_one(const Case& c) {
  SCOPED_TRACE(fmt::format("{}: {} x {} chunks, {} micro-batches per rank, checkpointing {}", c.model,
                           pipeline_schedule_name(c.kind), c.virtual_stages, c.micro_batches,
                           static_cast<int>(c.mode)));
  ConfigOverrides keys = {{"model.name", c.model}, {"model.num_layers", "4"}};
  keys.insert(keys.end(), c.overrides.begin(), c.overrides.end());
  const ModelConfig m = load_experiment("", keys).model;
  const int stages = 2, ep = kExpertParallel, ranks = stages * ep, local = static_cast<int>(m.num_experts) / ep;
  const int64_t micro = 2, seq = 8;
  // Micro-batch k of expert-parallel rank e: tokens[e][k].
  std::vector<std::vector<Tensor>> tokens(ep), targets(ep);
  for (int e = 0; e < ep; ++e)
    for (int k = 0; k < c.micro_batches; ++k) {
      const uint64_t seed = 11 + 2 * static_cast<uint64_t>(e * c.micro_batches + k);
      tokens[static_cast<size_t>(e)].push_back(testing::random_tokens(micro, seq, m.vocab_size, seed));
      targets[static_cast<size_t>(e)].push_back(testing::random_tokens(micro, seq, m.vocab_size, seed + 1));
    }
  const float scale = 1.0f / static_cast<float>(ep * c.micro_batches * micro * seq);

  // One rank: every micro-batch of both expert-parallel ranks, one after the other; with the
  // global loss, the ranks' k-th micro-batches as one.
  FlatParameters params(m), reference_grads(m);
  params.initialize(5);
  reference_grads.zero();
  ModelConfig reference_model = m;
  if (c.global_loss) reference_model.router_aux_loss_coef /= ep;
  const int64_t reference_rows = c.global_loss ? ep * micro : micro;
  DecoderLM one(reference_model, reference_rows, seq, Device::CPU, DType::F32, c.mode);
  auto rows_of_ranks = [&](const std::vector<std::vector<Tensor>>& of, int k) {
    Tensor all = Tensor::empty({ep * micro, seq}, DType::I32);
    for (int e = 0; e < ep; ++e) all.narrow(e * micro, (e + 1) * micro).copy_from(of[static_cast<size_t>(e)][static_cast<size_t>(k)]);
    return all;
  };
  LossSum reference;
  std::vector<std::vector<int64_t>> reference_load;
  for (int e = 0; e < (c.global_loss ? 1 : ep); ++e)
    for (int k = 0; k < c.micro_batches; ++k) {
      const LossSum l =
          c.global_loss
              ? one.forward_backward(rows_of_ranks(tokens, k), rows_of_ranks(targets, k), params, reference_grads, scale)
              : one.forward_backward(tokens[static_cast<size_t>(e)][static_cast<size_t>(k)],
                                     targets[static_cast<size_t>(e)][static_cast<size_t>(k)], params, reference_grads,
                                     scale);
      reference.sum += l.sum;
      reference.tokens += l.tokens;
      const std::vector<std::vector<int64_t>> load = one.expert_load();
      if (reference_load.empty()) reference_load.assign(load.size(), std::vector<int64_t>(load[0].size(), 0));
      for (size_t b = 0; b < load.size(); ++b)
        for (size_t x = 0; x < load[b].size(); ++x) reference_load[b][x] += load[b][x];
    }

  std::vector<std::vector<PipelineStage>> held(static_cast<size_t>(ranks));
  std::vector<std::unique_ptr<FlatParameters>> weights, grads;
  for (int r = 0; r < ranks; ++r) {
    for (int v = 0; v < c.virtual_stages; ++v)
      held[static_cast<size_t>(r)].push_back(pipeline_stage(m, stages, c.virtual_stages, r / ep, v));
    weights.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{},
                                                       held[static_cast<size_t>(r)]));
    weights.back()->initialize(5);
    grads.push_back(std::make_unique<FlatParameters>(m, Device::CPU, DType::F32, TensorParallelShard{},
                                                     held[static_cast<size_t>(r)]));
    grads.back()->zero();
  }
  std::vector<LossSum> losses(static_cast<size_t>(ranks));
  std::vector<std::vector<std::vector<int64_t>>> loads(static_cast<size_t>(ranks));
  const int port = testing::free_port();
  const auto errors = testing::run_ranks(ranks, [&](int r) {
    auto world = create_process_group(testing::env_of(r, ranks, port), quick_options());
    // NOTE [Device mesh]: the ranks of one expert-parallel rank form a pipeline, the ranks of
    // one stage an expert-parallel group.
    std::unique_ptr<ProcessGroup> pipeline_group = world->split(r % ep, r);
    std::unique_ptr<ProcessGroup> expert_group = world->split(r / ep, r);
    GroupPipelineParallel pp(*pipeline_group);
    GroupExpertDispatch experts(*expert_group, Device::CPU);
    DataParallelComm counts(Device::CPU, *expert_group, nullptr);  // the stage's data-parallel ranks
    PipelineModel model(m, micro, seq, Device::CPU, DType::F32, c.mode, pp, c.kind,
                        {stages, c.virtual_stages, c.micro_batches}, nullptr, nullptr, &experts);
    if (c.global_loss) model.set_data_parallel_counts(&counts);
    const size_t i = static_cast<size_t>(r), e = static_cast<size_t>(r % ep);
    std::vector<PipelineMicroBatch> batches;
    for (int k = 0; k < c.micro_batches; ++k)
      batches.push_back({tokens[e][static_cast<size_t>(k)], targets[e][static_cast<size_t>(k)], nullptr});
    LocalExperts w(*weights[i], static_cast<int64_t>(e) * local, local, &held[i]);
    LocalExperts g(*grads[i], static_cast<int64_t>(e) * local, local, &held[i]);
    losses[i] = model.forward_backward(batches, w, g, scale);
    loads[i] = model.expert_load();
    world->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  // The cross-entropy is on the last stage's ranks, the auxiliary losses each stage's: the
  // sum over every rank is one rank's over all the micro-batches.
  double step_sum = 0;
  for (const LossSum& l : losses) step_sum += l.sum;
  EXPECT_NEAR(step_sum, reference.sum, 1e-5 * std::abs(reference.sum));
  EXPECT_EQ(losses[2].tokens + losses[3].tokens, reference.tokens);
  for (size_t b = 0; b < reference_load.size(); ++b)
    for (size_t x = 0; x < reference_load[b].size(); ++x) {
      int64_t sum = 0;
      for (const auto& load : loads) sum += load.at(b).at(x);
      EXPECT_EQ(sum, reference_load[b][x]) << "MoE block " << b << ", expert " << x;
    }
  for (size_t s = 0; s < params.specs().size(); ++s) {
    const ParamSpec& spec = params.specs()[s];
    const Tensor& expected = reference_grads.tensors()[s];
    int holders = 0;
    Tensor sum = Tensor::zeros(expected.shape(), DType::F32);
    for (int r = 0; r < ranks; ++r) {
      const FlatParameters& mine = *grads[static_cast<size_t>(r)];
      const auto at = std::find_if(mine.specs().begin(), mine.specs().end(),
                                   [&](const ParamSpec& p) { return p.name == spec.name; });
      if (at == mine.specs().end()) continue;
      ++holders;
      const Tensor& got = mine.tensors()[static_cast<size_t>(at - mine.specs().begin())];
      if (spec.expert_stack) {  // its local experts' slice, over every rank's tokens
        const int64_t first = static_cast<int64_t>(r % ep) * local;
        EXPECT_LT(relative_gap(got.narrow(first, first + local), expected.narrow(first, first + local)), 2e-5)
            << spec.name << "'s experts on rank " << r;
      } else {
        for (int64_t k = 0; k < got.numel(); ++k) sum.data<float>()[k] += got.data<float>()[k];
      }
    }
    EXPECT_EQ(holders, ep) << spec.name;  // the two ranks of its stage
    if (!spec.expert_stack) EXPECT_LT(relative_gap(sum, expected), 2e-5) << spec.name << " summed over its stage";
  }
}

TEST(ModelPipelineExpertParallel, MixtralStagesMatchOneRank) {
  const ConfigOverrides losses = {{"model.router_aux_loss_coef", "0.1"},
                                  {"model.router_aux_loss_type", "per_layer"},
                                  {"model.router_z_loss_coef", "0.01"}};
  expect_ranks_match_one({"debug-tiny-moe", PipelineScheduleKind::OneFOneB, 1, 3, ActivationCheckpoint::None, losses});
  expect_ranks_match_one(
      {"debug-tiny-moe", PipelineScheduleKind::Interleaved, 2, 4, ActivationCheckpoint::Selective, losses});
}

TEST(ModelPipelineExpertParallel, PooledBalancingLossMatchesOneRank) {
  // NOTE [Pooled balancing loss across stages]: each expert-parallel rank's pipeline carries
  // its own tokens' statistics (routed before the dispatch), as one rank's micro-batch.
  const ConfigOverrides losses = {{"model.router_aux_loss_coef", "0.1"}, {"model.router_aux_loss_type", "pooled"}};
  expect_ranks_match_one({"debug-tiny-moe", PipelineScheduleKind::OneFOneB, 1, 3, ActivationCheckpoint::Full, losses});
  expect_ranks_match_one({"debug-tiny-mla", PipelineScheduleKind::Interleaved, 2, 2, ActivationCheckpoint::None, losses});
}

TEST(ModelPipelineExpertParallel, GlobalBalancingLossMatchesOneRank) {
  // NOTE [Global balancing loss across stages]: each chunk's counts of its micro-batches in
  // flight, summed over the stage's ranks, among the expert-parallel all-to-alls.
  const ConfigOverrides losses = {{"model.router_aux_loss_coef", "0.5"},
                                  {"model.router_aux_loss_type", "global"},
                                  {"model.init_std", "0.3"}};  // routers far from uniform
  expect_ranks_match_one(
      {"debug-tiny-moe", PipelineScheduleKind::OneFOneB, 1, 3, ActivationCheckpoint::Selective, losses, true});
  expect_ranks_match_one(
      {"debug-tiny-mla", PipelineScheduleKind::Interleaved, 2, 4, ActivationCheckpoint::Full, losses, true});
}

TEST(ModelPipelineExpertParallel, DeepSeekStagesMatchOneRank) {
  const ConfigOverrides losses = {{"model.router_aux_loss_coef", "0.1"}, {"model.router_aux_loss_type", "sequence"}};
  // Stage 0: the dense block and an MoE one.
  expect_ranks_match_one({"debug-tiny-mla", PipelineScheduleKind::OneFOneB, 1, 2, ActivationCheckpoint::Full, losses});
  // Stage 0 (chunk 0 of rank 0): the dense block alone, which dispatches nothing.
  expect_ranks_match_one(
      {"debug-tiny-mla", PipelineScheduleKind::Interleaved, 2, 2, ActivationCheckpoint::None, losses});
}

}  // namespace
}  // namespace forge
