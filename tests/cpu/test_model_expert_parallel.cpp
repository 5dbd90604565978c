// Expert parallelism in the model (NOTE [Expert parallelism] in model/expert_dispatch.h):
// P ranks (threads of this process over the CPU process group), each holding its local
// experts' slices and routing its own micro-batch, give the loss and the gradients one rank
// gives on all their tokens: the non-expert gradients summed over the ranks, each rank's
// experts' gradients its slice of the whole. Mixtral-style and DeepSeek-shaped models, every
// activation-checkpointing mode, 2 and 4 ranks, and a router that sends every token to the
// same two experts (the other ranks receive nothing, one rank receives past its pool); with
// Megatron's global balancing loss, whose counts are every rank's. FSDP's expert sharding and
// a whole training run are tested in tests/python/test_fsdp.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <mutex>

#include "cli/config.h"
#include "core/rng.h"
#include "distributed/data_parallel_comm.h"
#include "distributed/expert_dispatch_group.h"
#include "model/decoder_lm.h"
#include "model/fp8_projections.h"
#include "model/parameters.h"
#include "ops/fp8_statistics.h"
#include "model_testing.h"
#include "parallel_testing.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::LocalExperts;
using testing::relative_gap;

Tensor random_ids(int64_t rows, int64_t seq, int64_t vocab, uint64_t seed) {
  return testing::random_tokens(rows, seq, vocab, seed);
}

// Rows [first, first + count) of a [rows, seq] token tensor.
Tensor rows_of(const Tensor& t, int64_t first, int64_t count) {
  Tensor out = Tensor::empty({count, t.dim(1)}, DType::I32);
  out.copy_from(t.narrow(first, first + count));
  return out;
}

struct Case {
  std::string model;
  int ranks;
  ActivationCheckpoint mode;
  bool one_pair = false;  // a zero router: every token to experts 0 and 1 (ties go to the lower id)
  // Token dropping (NOTE [MoE capacity]): each rank drops by its own micro-batch's capacity,
  // so the reference is one rank run on each rank's micro-batch in turn, summed.
  double capacity_factor = 0.0;
  bool pad = false;
  // Megatron's global balancing loss (NOTE [MoE balancing loss]), its counts summed over the
  // ranks (DataParallelComm over the same group): the ranks' losses add up to one rank's on
  // all their tokens, whose step weighs them together, so the reference runs at 1 / P of the
  // coefficient.
  bool global_loss = false;
};

void expect_ranks_match_one(const Case& c) {
  SCOPED_TRACE(fmt::format("{} on {} ranks, checkpointing {}{}, capacity factor {}{}{}", c.model, c.ranks,
                           static_cast<int>(c.mode), c.one_pair ? ", every token to experts 0 and 1" : "",
                           c.capacity_factor, c.pad ? " padded" : "", c.global_loss ? ", global balancing loss" : ""));
  ConfigOverrides overrides = {{"model.name", c.model}};
  if (c.global_loss) {
    overrides.push_back({"model.router_aux_loss_type", "global"});
    overrides.push_back({"model.router_aux_loss_coef", "0.5"});
  }
  if (c.capacity_factor > 0) {
    overrides.push_back({"model.moe_capacity_factor", fmt::format("{}", c.capacity_factor)});
    overrides.push_back({"model.moe_pad_to_capacity", c.pad ? "true" : "false"});
  }
  const ModelConfig m = load_experiment("", overrides).model;
  const int64_t micro = 2, seq = 8, p = c.ranks, local = m.num_experts / p;
  ModelConfig reference_model = m;
  if (c.global_loss) reference_model.router_aux_loss_coef /= static_cast<double>(p);
  const Tensor tokens = random_ids(p * micro, seq, m.vocab_size, 11), targets = random_ids(p * micro, seq, m.vocab_size, 12);
  const float scale = 1.0f / static_cast<float>(p * micro * seq);

  FlatParameters params(m), reference_grads(m);
  params.initialize(5);
  if (c.one_pair)
    for (size_t s = 0; s < params.specs().size(); ++s)
      if (params.specs()[s].name.ends_with("moe.router.weight")) params.tensors()[s].fill_zero();
  LossSum reference;
  std::vector<std::vector<int64_t>> whole;  // the reference's loads
  if (c.capacity_factor == 0) {
    DecoderLM one(reference_model, p * micro, seq, Device::CPU, DType::F32, c.mode);
    reference = one.forward_backward(tokens, targets, params, reference_grads, scale);
    whole = one.expert_load();
  } else {  // each rank's micro-batch on one rank, its gradients summed
    reference_grads.zero();
    DecoderLM one(m, micro, seq, Device::CPU, DType::F32, c.mode);
    for (int r = 0; r < p; ++r) {
      FlatParameters g(m);
      const LossSum l = one.forward_backward(rows_of(tokens, r * micro, micro), rows_of(targets, r * micro, micro),
                                             params, g, scale);
      reference.sum += l.sum;
      reference.tokens += l.tokens;
      for (int64_t i = 0; i < g.flat().numel(); ++i) reference_grads.flat().data<float>()[i] += g.flat().data<float>()[i];
      const std::vector<std::vector<int64_t>> load = one.expert_load();
      if (whole.empty()) whole.assign(load.size(), {});
      for (size_t layer = 0; layer < load.size(); ++layer) {
        whole[layer].resize(load[layer].size(), 0);
        for (size_t e = 0; e < load[layer].size(); ++e) whole[layer][e] += load[layer][e];
      }
    }
  }

  std::vector<std::unique_ptr<FlatParameters>> grads;
  for (int r = 0; r < p; ++r) grads.push_back(std::make_unique<FlatParameters>(m));
  std::vector<LossSum> losses(static_cast<size_t>(p));
  std::vector<std::vector<std::vector<int64_t>>> loads(static_cast<size_t>(p));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(c.ranks, [&](int r) {
    auto group = create_process_group(testing::env_of(r, c.ranks, port), options);
    GroupExpertDispatch dispatch(*group, Device::CPU);
    DataParallelComm counts(Device::CPU, *group, nullptr);
    LocalExperts weights(params, r * local, local), sink(*grads[static_cast<size_t>(r)], r * local, local);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, c.mode, &dispatch);
    model.set_data_parallel_counts(&counts);
    losses[static_cast<size_t>(r)] = model.forward_backward(rows_of(tokens, r * micro, micro),
                                                            rows_of(targets, r * micro, micro), weights, sink, scale);
    loads[static_cast<size_t>(r)] = model.expert_load();
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  double sum = 0.0;
  int64_t targets_counted = 0;
  for (const LossSum& l : losses) {
    sum += l.sum;
    targets_counted += l.tokens;
  }
  EXPECT_EQ(targets_counted, reference.tokens);
  EXPECT_NEAR(sum, reference.sum, 1e-5 * std::abs(reference.sum));
  // Each rank's loads are its own tokens' choices; summed they are the whole batch's.
  for (size_t layer = 0; layer < whole.size(); ++layer) {
    std::vector<int64_t> total(whole[layer].size(), 0);
    for (const auto& rank : loads)
      for (size_t e = 0; e < total.size(); ++e) total[e] += rank[layer][e];
    EXPECT_EQ(total, whole[layer]) << "block " << layer;
    if (c.one_pair && !whole[layer].empty()) EXPECT_EQ(whole[layer][2], 0);
  }
  for (size_t s = 0; s < params.specs().size(); ++s) {
    const ParamSpec& spec = params.specs()[s];
    const Tensor& expected = reference_grads.tensors()[s];
    if (spec.expert_stack) {  // each rank computed its own experts' slice, from every rank's tokens
      for (int r = 0; r < p; ++r) {
        const Tensor mine = grads[static_cast<size_t>(r)]->tensors()[s].narrow(r * local, (r + 1) * local);
        EXPECT_LT(relative_gap(mine, expected.narrow(r * local, (r + 1) * local)), 1e-5)
            << spec.name << " on rank " << r;
      }
    } else {  // every rank's share of the batch, summed
      Tensor total = Tensor::zeros(expected.shape());
      for (const auto& g : grads)
        for (int64_t i = 0; i < total.numel(); ++i) total.data<float>()[i] += g->tensors()[s].data<float>()[i];
      EXPECT_LT(relative_gap(total, expected), 1e-5) << spec.name;
    }
  }
}

TEST(ModelExpertParallel, TwoAndFourRanksMatchOneMixtralStyle) {
  for (int ranks : {2, 4}) expect_ranks_match_one({"debug-tiny-moe", ranks, ActivationCheckpoint::None});
}

TEST(ModelExpertParallel, DeepSeekShapedInEveryCheckpointingMode) {
  for (ActivationCheckpoint mode : {ActivationCheckpoint::None, ActivationCheckpoint::Selective, ActivationCheckpoint::Full})
    expect_ranks_match_one({"debug-tiny-mla", 2, mode});
  expect_ranks_match_one({"debug-tiny-mla", 4, ActivationCheckpoint::Selective});
}

// Rank 0 holds experts 0 and 1 and receives every row. With 4 experts on 2 ranks that is
// twice its own rows per layer, what the received-row pool holds; with 8 on 4 ranks four
// times, so the second MoE layer's rows come from device allocations (NOTE [Received-row
// pool] in model/moe_feed_forward.cpp).
// Token dropping under expert parallelism: each rank drops by its own capacity and sends only
// what it keeps; padded, every chunk is the capacity and no counts are exchanged.
TEST(ModelExpertParallel, TokenDroppingMatchesEachRankAlone) {
  for (const bool pad : {false, true}) {
    expect_ranks_match_one({"debug-tiny-moe", 2, ActivationCheckpoint::None, false, 0.75, pad});
    expect_ranks_match_one({"debug-tiny-mla", 4, ActivationCheckpoint::Selective, false, 1.0, pad});
  }
  expect_ranks_match_one({"debug-tiny-mla", 2, ActivationCheckpoint::Full, false, 1.25, true});
}

TEST(ModelExpertParallel, EveryTokenOnOneRanksExpertsAndRanksThatReceiveNothing) {
  expect_ranks_match_one({"debug-tiny-moe", 2, ActivationCheckpoint::None, true});
  expect_ranks_match_one({"debug-tiny-mla", 4, ActivationCheckpoint::None, true});
  expect_ranks_match_one({"debug-tiny-mla", 4, ActivationCheckpoint::Selective, true});
  expect_ranks_match_one({"debug-tiny-mla", 4, ActivationCheckpoint::Full, true});
}

TEST(ModelExpertParallel, GlobalBalancingLossSumsTheRanksCounts) {
  expect_ranks_match_one({"debug-tiny-moe", 2, ActivationCheckpoint::None, false, 0.0, false, true});
  expect_ranks_match_one({"debug-tiny-mla", 4, ActivationCheckpoint::Selective, false, 0.0, false, true});
}

// NOTE [FP8 routed experts under expert parallelism] (ops/moe_fp8.h): each rank casts its
// local experts' received rows and weights with those experts' statistics blocks in the whole
// model's numbering, and the other ranks' experts' blocks see nothing there; the blocks'
// maximum over the ranks (what the trainer's step-end reduction takes) is one rank's over
// all the tokens: a weight's amax exactly, the rows' within FP8 rounding (each rank scales
// its own tokens' activations upstream, as data-parallel ranks do), and so are the loss and
// the experts' gradients, as close as data parallelism's (each micro-batch its own scales).
// Measured: loss 7.9e-5, the rows' amaxes 5.4e-2 (data parallelism's 8.0e-2), the experts'
// gradients 0.235 relative L2 (data parallelism's 0.243: E5M2's rounding of dy).
TEST(ModelExpertParallel, Fp8ExpertsCastWithTheirOwnStatisticsBlocks) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny-moe"}}).model;
  const int64_t micro = 2, seq = 8, p = 2, local = m.num_experts / p;
  const Tensor tokens = random_ids(p * micro, seq, m.vocab_size, 11), targets = random_ids(p * micro, seq, m.vocab_size, 12);
  const float scale = 1.0f / static_cast<float>(p * micro * seq);
  Fp8Settings settings;  // tensorwise: every cast folds its amax into the block's `seen`
  FlatParameters params(m), reference_grads(m);
  params.initialize(5);
  Fp8Projections reference(m, settings, Device::CPU, p * micro * seq);
  reference.set_base(params, reference_grads);
  DecoderLM one(m, p * micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None);
  const LossSum whole = one.forward_backward(tokens, targets, reference, reference, scale);

  std::vector<std::unique_ptr<FlatParameters>> grads;
  for (int r = 0; r < p; ++r) grads.push_back(std::make_unique<FlatParameters>(m));
  std::vector<Tensor> stats(static_cast<size_t>(p));
  std::vector<LossSum> losses(static_cast<size_t>(p));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(static_cast<int>(p), [&](int r) {
    auto group = create_process_group(testing::env_of(r, static_cast<int>(p), port), options);
    GroupExpertDispatch dispatch(*group, Device::CPU);
    LocalExperts weights(params, r * local, local), sink(*grads[static_cast<size_t>(r)], r * local, local);
    Fp8Projections fp8(m, settings, Device::CPU, micro * seq);
    fp8.set_base(weights, sink);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None, &dispatch);
    losses[static_cast<size_t>(r)] = model.forward_backward(rows_of(tokens, r * micro, micro),
                                                            rows_of(targets, r * micro, micro), fp8, fp8, scale);
    stats[static_cast<size_t>(r)] = fp8.statistics().clone();
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");
  EXPECT_NEAR(losses[0].sum + losses[1].sum, whole.sum, 1e-2 * std::abs(whole.sum));

  double rows_gap = 0.0;
  int blocks = 0;
  std::vector<char> block_is_expert(static_cast<size_t>(reference.statistics().numel() / cpu::kFp8ProjectionStats), 0);
  for (int layer = 0; layer < m.num_layers; ++layer)
    for (const char* stack : {"gate_up", "down"})
      for (int64_t e = 0; e < m.num_experts; ++e) {
        const int64_t block =
            reference.projection_index(fmt::format("layers.{}.moe.experts.{} (expert {})", layer, stack, e));
        ASSERT_GE(block, 0) << stack << " " << e;
        block_is_expert[static_cast<size_t>(block)] = 1;
        const int64_t owner = e / local;
        for (int role = 0; role < cpu::kFp8Roles; ++role) {
          const int64_t slot = block * cpu::kFp8Roles + role;
          const float expected = fp8_stats_seen(reference.statistics(), slot);
          for (int64_t r = 0; r < p; ++r) {
            const float seen = fp8_stats_seen(stats[static_cast<size_t>(r)], slot);
            if (r != owner) {
              EXPECT_EQ(seen, 0.0f) << "rank " << r << " cast expert " << e << "'s " << stack;
              continue;
            }
            if (role == static_cast<int>(cpu::Fp8Role::W)) {
              EXPECT_EQ(seen, expected) << "expert " << e << "'s " << stack << " weight";
            } else {
              ASSERT_GT(expected, 0.0f) << "expert " << e << " received no rows";
              rows_gap = std::max(rows_gap, std::abs(static_cast<double>(seen) - expected) / expected);
            }
          }
          ++blocks;
        }
      }
  EXPECT_EQ(blocks, m.num_layers * 2 * m.num_experts * cpu::kFp8Roles);
  EXPECT_LT(rows_gap, 0.1);
  // What data parallelism gives for comparison: each micro-batch through every expert with
  // scales of its own, the gradients summed.
  FlatParameters data_parallel(m);
  data_parallel.zero();
  DecoderLM half(m, micro, seq, Device::CPU, DType::F32, ActivationCheckpoint::None);
  std::vector<Tensor> data_parallel_stats;
  for (int r = 0; r < p; ++r) {
    FlatParameters g(m);
    Fp8Projections fp8(m, settings, Device::CPU, micro * seq);
    fp8.set_base(params, g);
    half.forward_backward(rows_of(tokens, r * micro, micro), rows_of(targets, r * micro, micro), fp8, fp8, scale);
    data_parallel_stats.push_back(fp8.statistics().clone());
    for (int64_t i = 0; i < g.flat().numel(); ++i) data_parallel.flat().data<float>()[i] += g.flat().data<float>()[i];
  }
  auto relative_l2 = [](const Tensor& a, const Tensor& b) {
    double diff = 0.0, norm = 0.0;
    for (int64_t i = 0; i < b.numel(); ++i) {
      const double d = static_cast<double>(a.data<float>()[i]) - b.data<float>()[i];
      diff += d * d;
      norm += static_cast<double>(b.data<float>()[i]) * b.data<float>()[i];
    }
    return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  };
  double experts_gap = 0.0, data_parallel_gap = 0.0;
  for (size_t s = 0; s < params.specs().size(); ++s) {
    if (!params.specs()[s].expert_stack) continue;
    for (int r = 0; r < p; ++r) {
      const Tensor expected = reference_grads.tensors()[s].narrow(r * local, (r + 1) * local).clone();
      const Tensor mine = grads[static_cast<size_t>(r)]->tensors()[s].narrow(r * local, (r + 1) * local).clone();
      const Tensor theirs = data_parallel.tensors()[s].narrow(r * local, (r + 1) * local).clone();
      experts_gap = std::max(experts_gap, relative_l2(mine, expected));
      data_parallel_gap = std::max(data_parallel_gap, relative_l2(theirs, expected));
    }
  }
  // E5M2's rounding of dy at other scales moves the weight gradients alike either way.
  EXPECT_LT(experts_gap, 1.5 * data_parallel_gap);
  double data_parallel_rows_gap = 0.0;  // the data-parallel runs' amaxes, max-reduced, against one rank's
  for (int64_t block = 0; block < static_cast<int64_t>(reference.statistics().numel() / cpu::kFp8ProjectionStats);
       ++block)
    for (int role : {static_cast<int>(cpu::Fp8Role::X), static_cast<int>(cpu::Fp8Role::Dy)}) {
      const int64_t slot = block * cpu::kFp8Roles + role;
      const float expected = fp8_stats_seen(reference.statistics(), slot);
      if (expected == 0.0f || block_is_expert[static_cast<size_t>(block)] == 0) continue;
      const float seen =
          std::max(fp8_stats_seen(data_parallel_stats[0], slot), fp8_stats_seen(data_parallel_stats[1], slot));
      data_parallel_rows_gap =
          std::max(data_parallel_rows_gap, std::abs(static_cast<double>(seen) - expected) / expected);
    }
  std::printf("FP8 experts under expert parallelism 2: loss %.3e, the rows' amaxes %.3e, the experts' gradients "
              "%.3e (relative L2) of one rank's on all the tokens; data parallelism's: the amaxes %.3e, the "
              "gradients %.3e\n",
              std::abs(losses[0].sum + losses[1].sum - whole.sum) / std::abs(whole.sum), rows_gap, experts_gap,
              data_parallel_rows_gap, data_parallel_gap);
}

TEST(ModelExpertParallel, TheDegreeMustDivideTheExperts) {
  const ModelConfig m = load_experiment("", {{"model.name", "debug-tiny-moe"}}).model;  // 4 experts
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  const auto errors = testing::run_ranks(3, [&](int r) {
    auto group = create_process_group(testing::env_of(r, 3, port), options);
    GroupExpertDispatch dispatch(*group, Device::CPU);
    DecoderLM model(m, 1, 4, Device::CPU, DType::F32, ActivationCheckpoint::None, &dispatch);
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("expert parallelism over 3 ranks needs a Mixture-of-Experts model whose experts it divides (4 experts)"),
              std::string::npos)
        << e;
}

}  // namespace
}  // namespace forge
