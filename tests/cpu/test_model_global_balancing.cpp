// Megatron's global balancing loss in the model (model.router_aux_loss_type global, NOTE [MoE
// balancing loss] in model/moe_feed_forward.h): each micro-batch's tokens per expert summed
// over the data-parallel ranks (ranks as threads of this process over the CPU process group,
// summed through DataParallelComm as the trainer's are), averaged over the optimizer step's
// micro-batches so far, and started over at each step (DecoderLM::begin_step). The models
// here have their attention's output projections and their experts' down projections zero,
// so that every MoE layer's input is the token's embedding row: the test then routes those
// rows itself (rmsnorm, the router, the softmax routing) and computes each rank's loss and
// router gradients from Megatron's formula with every rank's counts. Megatron's own
// functions are compared in tests/python/test_moe_vs_megatron.py.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <memory>
#include <vector>

#include "cli/config.h"
#include "distributed/data_parallel_comm.h"
#include "model/decoder_lm.h"
#include "model/parameters.h"
#include "model_testing.h"
#include "ops_testing.h"
#include "parallel_testing.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/rmsnorm.h"
#include "rank_threads.h"

namespace forge {
namespace {

using namespace std::chrono_literals;

ModelConfig global_moe(const ConfigOverrides& more = {}) {
  ConfigOverrides overrides = {{"model.name", "debug-tiny-moe"},
                               {"model.router_aux_loss_coef", "0.5"},
                               {"model.router_aux_loss_type", "global"},
                               {"model.init_std", "0.3"}};  // routers far from uniform
  overrides.insert(overrides.end(), more.begin(), more.end());
  return load_experiment("", overrides).model;
}

// Weights whose blocks pass the embedding rows through unchanged: every attention output
// projection and every expert's down projection zero.
void pass_embeddings_through(FlatParameters& params) {
  for (size_t s = 0; s < params.specs().size(); ++s) {
    const std::string& name = params.specs()[s].name;
    if (name.ends_with("attention.o.weight") || name.ends_with("moe.experts.down")) params.tensors()[s].fill_zero();
  }
}

// One rank's micro-batch as the test routes it itself: per MoE layer, the routing of its
// tokens' embedding rows and their normalized rows.
struct LayerRouting {
  Tensor normed;
  MoeRouting routing;
};

std::vector<LayerRouting> route_embeddings(const ModelConfig& m, const FlatParameters& params, const Tensor& tokens) {
  const int64_t n = tokens.numel(), h = m.hidden_size;
  Tensor x = Tensor::empty({n, h});
  const Tensor& embedding = params.find("embedding.weight");
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < h; ++j)
      x.data<float>()[t * h + j] = embedding.data<float>()[tokens.data<int32_t>()[t] * h + j];
  std::vector<LayerRouting> layers;
  for (int l = 0; l < m.num_layers; ++l) {
    LayerRouting r;
    r.normed = Tensor::empty({n, h});
    Tensor rstd = Tensor::empty({n}), logits = Tensor::empty({n, m.num_experts});
    rmsnorm_forward(r.normed, rstd, x, params.find(fmt::format("layers.{}.mlp_norm.weight", l)),
                    static_cast<float>(m.norm_eps));
    linear_forward(logits, r.normed, {params.find(fmt::format("layers.{}.moe.router.weight", l))});
    r.routing = moe_route(logits, m.num_experts_per_tok, m.router_normalize_topk);
    layers.push_back(std::move(r));
  }
  return layers;
}

// A rank's micro-batch as the model computed it: its balancing loss (training minus
// evaluation, per target) and every layer's router gradient.
struct Observed {
  double aux = 0.0;
  std::vector<Tensor> router_grads;
};

// Megatron's formula for one rank's micro-batch: per layer E / (k T^2) sum_e c_e P_e, c the
// step's average so far of the counts summed over the ranks, T = N x ranks; and the router
// gradient that loss gives (times `weight`, the micro-batch's gradient weight), through the
// softmax's probabilities alone.
void expect_formula(const ModelConfig& m, const std::vector<LayerRouting>& mine, const std::vector<double>& average,
                    int64_t ranks, double weight, const Observed& got, const std::string& where) {
  const int64_t e = m.num_experts, k = m.num_experts_per_tok;
  double want = 0.0;
  for (size_t l = 0; l < mine.size(); ++l) {
    const MoeRouting& r = mine[l].routing;
    const double t = static_cast<double>(r.tokens * ranks), scale = static_cast<double>(e) / (k * t * t);
    Tensor prob_gradient = Tensor::empty({e});
    for (int64_t x = 0; x < e; ++x) {
      double p = 0.0;
      for (int64_t i = 0; i < r.tokens; ++i) p += r.probs.data<float>()[i * e + x];
      const double c = average[l * static_cast<size_t>(e) + static_cast<size_t>(x)];
      want += m.router_aux_loss_coef * scale * c * p;
      prob_gradient.data<float>()[x] = static_cast<float>(m.router_aux_loss_coef * weight * scale * c);
    }
    // The router's gradient: d_logits^T normed, d_logits from the probabilities' gradient alone
    // (the experts' outputs are zero, so the routing weights take none).
    Tensor d_logits = Tensor::empty({r.tokens, e});
    moe_route_backward(d_logits, Tensor::zeros({r.tokens, k}), r, &prob_gradient);
    const int64_t h = mine[l].normed.dim(1);
    std::vector<double> grad(static_cast<size_t>(e * h), 0.0);
    double norm = 0.0, diff = 0.0;
    for (int64_t x = 0; x < e; ++x)
      for (int64_t j = 0; j < h; ++j) {
        double g = 0.0;
        for (int64_t i = 0; i < r.tokens; ++i)
          g += static_cast<double>(d_logits.data<float>()[i * e + x]) * mine[l].normed.data<float>()[i * h + j];
        const double d = got.router_grads[l].data<float>()[x * h + j] - g;
        norm += g * g;
        diff += d * d;
      }
    EXPECT_GT(norm, 0.0) << where << ", layer " << l;
    EXPECT_LT(std::sqrt(diff / norm), 1e-5) << where << ", layer " << l << "'s router gradient";
  }
  EXPECT_GT(want, 0.0);
  EXPECT_NEAR(got.aux, want, 1e-6 * want) << where;
}

// Runs `micro_batches` micro-batches per step for `steps` steps on `ranks` ranks, rank r's
// micro-batch i of the run being rows of tokens[(i * ranks + r) * micro ...], and checks every
// rank's every micro-batch against the formula.
void expect_global_loss(const ModelConfig& m, int ranks, int64_t micro_batches, int64_t steps,
                        ActivationCheckpoint mode) {
  SCOPED_TRACE(fmt::format("{} ranks, {} micro-batches per step, {} steps, {}", ranks, micro_batches, steps,
                           activation_checkpoint_name(mode)));
  const int64_t micro = 2, seq = 6, n = micro * seq, runs = micro_batches * steps;
  const Tensor tokens = testing::random_tokens(ranks * runs * micro, seq, m.vocab_size, 31);
  FlatParameters params(m);
  params.initialize(8);
  pass_embeddings_through(params);
  auto batch = [&](int64_t i, int r) {
    Tensor rows = Tensor::empty({micro, seq}, DType::I32);
    rows.copy_from(tokens.narrow((i * ranks + r) * micro, (i * ranks + r + 1) * micro));
    return rows;
  };
  const float grad_scale = 1.0f / static_cast<float>(n);

  // observed[i][r]: rank r's micro-batch i.
  std::vector<std::vector<Observed>> observed(static_cast<size_t>(runs),
                                              std::vector<Observed>(static_cast<size_t>(ranks)));
  const int port = testing::free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 20s;
  options.collective_timeout = 20s;
  const auto errors = testing::run_ranks(ranks, [&](int r) {
    auto group = create_process_group(testing::env_of(r, ranks, port), options);
    DataParallelComm comm(Device::CPU, *group, nullptr);
    DecoderLM model(m, micro, seq, Device::CPU, DType::F32, mode);
    model.set_data_parallel_counts(&comm);
    FlatParameters grads(m);
    for (int64_t s = 0; s < steps; ++s) {
      model.begin_step();
      for (int64_t i = s * micro_batches; i < (s + 1) * micro_batches; ++i) {
        const Tensor b = batch(i, r);
        grads.discard();
        const LossSum train = model.forward_backward(b, b, params, grads, grad_scale);
        const LossSum eval = model.forward_loss(b, b, params);
        Observed& o = observed[static_cast<size_t>(i)][static_cast<size_t>(r)];
        o.aux = (train.sum - eval.sum) / static_cast<double>(train.tokens);
        for (int l = 0; l < m.num_layers; ++l) {
          Tensor g = Tensor::empty({m.num_experts, m.hidden_size});
          g.copy_from(grads.find(fmt::format("layers.{}.moe.router.weight", l)));
          o.router_grads.push_back(std::move(g));
        }
      }
    }
    group->barrier();
  });
  for (const std::string& e : errors) ASSERT_EQ(e, "");

  const size_t counts = static_cast<size_t>(m.num_layers * m.num_experts);
  for (int64_t s = 0; s < steps; ++s) {
    std::vector<double> sums(counts, 0.0);
    for (int64_t i = s * micro_batches; i < (s + 1) * micro_batches; ++i) {
      std::vector<std::vector<LayerRouting>> routed;
      for (int r = 0; r < ranks; ++r) {
        routed.push_back(route_embeddings(m, params, batch(i, r)));
        for (size_t l = 0; l < routed.back().size(); ++l) {
          const std::vector<int64_t> c = moe_expert_counts(routed.back()[l].routing).assigned;
          for (size_t x = 0; x < c.size(); ++x) sums[l * c.size() + x] += static_cast<double>(c[x]);
        }
      }
      std::vector<double> average(counts);
      for (size_t j = 0; j < counts; ++j) average[j] = sums[j] / static_cast<double>(i - s * micro_batches + 1);
      for (int r = 0; r < ranks; ++r)
        expect_formula(m, routed[static_cast<size_t>(r)], average, ranks, grad_scale * static_cast<double>(n),
                       observed[static_cast<size_t>(i)][static_cast<size_t>(r)],
                       fmt::format("step {}, micro-batch {}, rank {}", s, i - s * micro_batches, r));
    }
  }
  // The counts matter: different micro-batches give the ranks different losses, and the same
  // rank's later micro-batches of a step take the earlier ones' counts.
  EXPECT_NE(observed[0][0].aux, observed[static_cast<size_t>(runs - 1)][static_cast<size_t>(ranks - 1)].aux);
}

// On one rank (no DataParallelCounts) the step's first micro-batch gives Megatron's per-layer
// loss: its own counts over its own tokens; the later ones the step's average.
TEST(ModelGlobalBalancing, OneRankFirstMicroBatchIsThePerLayerLoss) {
  const ModelConfig global = global_moe(), per_layer = global_moe({{"model.router_aux_loss_type", "per_layer"}});
  const int64_t batch = 2, seq = 8;
  const Tensor tokens = testing::random_tokens(batch, seq, global.vocab_size, 5);
  FlatParameters params(global), a(global), b(global);
  params.initialize(6);
  DecoderLM g(global, batch, seq), p(per_layer, batch, seq);
  const float scale = 1.0f / static_cast<float>(batch * seq);
  for (int step = 0; step < 2; ++step) {
    g.begin_step();
    a.discard();
    b.discard();
    const LossSum lg = g.forward_backward(tokens, tokens, params, a, scale);
    const LossSum lp = p.forward_backward(tokens, tokens, params, b, scale);
    EXPECT_GT(lg.sum - g.forward_loss(tokens, tokens, params).sum, 1e-2) << "step " << step;
    EXPECT_NEAR(lg.sum, lp.sum, 1e-12 * lp.sum) << "step " << step;
    EXPECT_LT(testing::relative_gap(a.flat(), b.flat()), 1e-6) << "step " << step;
  }
}

TEST(ModelGlobalBalancing, OneRankAveragesTheStepsMicroBatches) {
  expect_global_loss(global_moe(), 1, 3, 2, ActivationCheckpoint::None);
}

TEST(ModelGlobalBalancing, TwoRanksSumTheirCountsOverMicroBatchesAndSteps) {
  expect_global_loss(global_moe(), 2, 2, 2, ActivationCheckpoint::None);
  expect_global_loss(global_moe(), 2, 3, 1, ActivationCheckpoint::Full);
}

// Token dropping: the counts are the router's choices before the drop (NOTE [MoE capacity]).
TEST(ModelGlobalBalancing, ThreeRanksWithTokenDropping) {
  expect_global_loss(global_moe({{"model.moe_capacity_factor", "0.75"}}), 3, 2, 2, ActivationCheckpoint::Selective);
}

}  // namespace
}  // namespace forge
