// The MoE routing and token-movement ops (ops/moe.h, NOTE [MoE routing]) on the CPU:
//  - routing against a double-precision softmax and top-k, with and without Mixtral's
//    renormalization, and the sort by expert (stable, every expert's rows contiguous, an
//    expert with no tokens);
//  - a whole Mixtral-style MoE feed-forward composed from them and the linear and SwiGLU
//    ops (router, permute, per-expert GEMMs on contiguous rows, combine with the residual)
//    against a per-token double-precision reference, and its backward against central finite
//    differences for the input, the router and every expert's weights, with and without the
//    balancing loss (transformers' form, and Megatron's global form with counts from
//    elsewhere, which take no gradient);
//  - Megatron's global form's loss with given counts and its step counts' running average;
//  - bad inputs refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "expect_error.h"
#include "ops/moe.h"
#include "moe_testing.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::finite_difference;
using testing::MoeActivations;
using testing::MoeGrads;
using testing::MoeLayer;
using testing::moe_backward;
using testing::moe_forward;
using testing::random_tensor;
using testing::relative_error;

TEST(OpsMoe, RoutingMatchesDoubleSoftmaxTopK) {
  Rng rng(71);
  for (const bool normalize : {true, false}) {
    const int64_t tokens = 9, experts = 6, k = 2;
    Tensor logits = random_tensor({tokens, experts}, rng, 2.0);
    for (int64_t t = 0; t < tokens; ++t) logits.data<float>()[t * experts + 4] = -30.0f;  // expert 4 gets no token
    const MoeRouting r = moe_route(logits, k, normalize);
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> p(experts);
      double sum = 0.0;
      for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(static_cast<double>(logits.data<float>()[t * experts + e]));
      for (double& v : p) v /= sum;
      std::vector<int> order(experts);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a] > p[b]; });
      const double chosen = p[order[0]] + p[order[1]];
      for (int64_t e = 0; e < experts; ++e) EXPECT_NEAR(r.probs.data<float>()[t * experts + e], p[e], 1e-6);
      for (int64_t j = 0; j < k; ++j) {
        EXPECT_EQ(r.expert_ids.data<int32_t>()[t * k + j], order[j]);
        EXPECT_NEAR(r.weights.data<float>()[t * k + j], normalize ? p[order[j]] / chosen : p[order[j]], 1e-6);
      }
    }
    // The sort: offsets count each expert's assignments, source and row_of invert each other,
    // rows are grouped by expert in ascending assignment order.
    EXPECT_EQ(r.offsets.front(), 0);
    EXPECT_EQ(r.offsets.back(), tokens * k);
    EXPECT_EQ(r.rows(4), 0);
    for (int64_t e = 0; e < experts; ++e) {
      int64_t count = 0;
      for (int64_t a = 0; a < tokens * k; ++a) count += r.expert_ids.data<int32_t>()[a] == e;
      EXPECT_EQ(r.rows(e), count) << "expert " << e;
      for (int64_t row = r.offsets[e]; row < r.offsets[e + 1]; ++row) {
        const int32_t a = r.source.data<int32_t>()[row];
        EXPECT_EQ(r.expert_ids.data<int32_t>()[a], e);
        EXPECT_EQ(r.row_of.data<int32_t>()[a], row);
        if (row > r.offsets[e]) EXPECT_LT(r.source.data<int32_t>()[row - 1], a);
      }
    }
  }
}

MoeLayer random_layer(Rng& rng, int64_t hidden, int64_t ffn, int64_t experts, int64_t k, bool normalize) {
  return {hidden, ffn, experts, k, normalize, random_tensor({experts, hidden}, rng, 0.7),
          random_tensor({experts, 2 * ffn, hidden}, rng, 0.4), random_tensor({experts, hidden, ffn}, rng, 0.4)};
}

TEST(OpsMoe, FeedForwardMatchesPerTokenDoubleReference) {
  Rng rng(72);
  for (const bool normalize : {true, false}) {
    const MoeLayer m = random_layer(rng, 8, 12, 5, 2, normalize);
    const int64_t tokens = 7;
    Tensor x = random_tensor({tokens, m.hidden}, rng);
    MoeActivations a;
    const Tensor out = moe_forward(m, x, a);
    std::vector<double> want(static_cast<size_t>(tokens * m.hidden));
    const float* xs = x.data<float>();
    for (int64_t t = 0; t < tokens; ++t) {
      std::vector<double> p(m.experts);
      double sum = 0.0;
      for (int64_t e = 0; e < m.experts; ++e) {
        double l = 0.0;
        for (int64_t h = 0; h < m.hidden; ++h) l += static_cast<double>(m.router.data<float>()[e * m.hidden + h]) * xs[t * m.hidden + h];
        sum += p[e] = std::exp(l);
      }
      for (double& v : p) v /= sum;
      std::vector<int> order(m.experts);
      std::iota(order.begin(), order.end(), 0);
      std::sort(order.begin(), order.end(), [&](int a1, int b1) { return p[a1] > p[b1]; });
      double chosen = 0.0;
      for (int64_t j = 0; j < m.k; ++j) chosen += p[order[j]];
      for (int64_t h = 0; h < m.hidden; ++h) want[t * m.hidden + h] = xs[t * m.hidden + h];
      for (int64_t j = 0; j < m.k; ++j) {
        const int e = order[j];
        const double w = normalize ? p[e] / chosen : p[e];
        const float* gu = m.gate_up.data<float>() + e * 2 * m.ffn * m.hidden;
        const float* dn = m.down.data<float>() + e * m.hidden * m.ffn;
        std::vector<double> hmid(m.ffn);
        for (int64_t f = 0; f < m.ffn; ++f) {
          double gate = 0.0, up = 0.0;
          for (int64_t h = 0; h < m.hidden; ++h) {
            gate += static_cast<double>(gu[f * m.hidden + h]) * xs[t * m.hidden + h];
            up += static_cast<double>(gu[(m.ffn + f) * m.hidden + h]) * xs[t * m.hidden + h];
          }
          hmid[f] = gate / (1.0 + std::exp(-gate)) * up;
        }
        for (int64_t h = 0; h < m.hidden; ++h) {
          double y = 0.0;
          for (int64_t f = 0; f < m.ffn; ++f) y += static_cast<double>(dn[h * m.ffn + f]) * hmid[f];
          want[t * m.hidden + h] += w * y;
        }
      }
    }
    EXPECT_LT(relative_error(out, want), 1e-5) << (normalize ? "normalized" : "not normalized");
  }
}

// The layer's backward (its balancing loss included when m.aux is set) against central
// finite differences for the input, the router and both expert weights, with dout as the
// loss's weights.
void expect_backward_matches_finite_differences(MoeLayer& m, Tensor& x, const Tensor& dout) {
  auto loss = [&] {
    MoeActivations a;
    const Tensor out = moe_forward(m, x, a);
    return testing::weighted_sum(out, dout) + (m.aux != 0.0f ? m.aux * testing::moe_layer_balance(m, a).loss : 0.0) +
           (m.z != 0.0f ? m.z * moe_z_loss(a.routing) : 0.0);
  };
  MoeActivations a;
  moe_forward(m, x, a);
  const MoeGrads g = moe_backward(m, x, a, dout);
  EXPECT_LT(relative_error(g.dx, finite_difference(x, loss, 1e-3f)), 1e-2);
  EXPECT_LT(relative_error(g.router, finite_difference(m.router, loss, 1e-3f)), 1e-2);
  EXPECT_LT(relative_error(g.gate_up, finite_difference(m.gate_up, loss, 1e-3f)), 1e-2);
  EXPECT_LT(relative_error(g.down, finite_difference(m.down, loss, 1e-3f)), 1e-2);
}

TEST(OpsMoe, BackwardMatchesFiniteDifferences) {
  Rng rng(73);
  struct Case {
    int64_t experts, k, tokens;
  };
  // The second case leaves at least 6 of its 8 experts without a token.
  for (const Case c : {Case{4, 2, 5}, Case{8, 1, 2}})
  for (const float aux : {0.0f, 0.5f}) {
    for (const bool normalize : {true, false}) {
      SCOPED_TRACE(::testing::Message() << c.experts << " experts, top-" << c.k << ", "
                                        << (normalize ? "normalized" : "not normalized") << ", aux " << aux);
      MoeLayer m = random_layer(rng, 6, 5, c.experts, c.k, normalize);
      m.aux = aux;
      const int64_t tokens = c.tokens;
      Tensor x = random_tensor({tokens, m.hidden}, rng), r = random_tensor({tokens, m.hidden}, rng);
      expect_backward_matches_finite_differences(m, x, r);
    }
  }
}

// DeepSeek-V3's sigmoid routing: scores, the bias steering the choice only, the group limit,
// the weights; then the layer's backward against finite differences.
TEST(OpsMoe, SigmoidGroupLimitedRouting) {
  Rng rng(74);
  const int64_t tokens = 6, experts = 8, k = 2, groups = 4, topk_groups = 2;
  Tensor logits = random_tensor({tokens, experts}, rng, 1.5), bias = random_tensor({experts}, rng, 0.3);
  const MoeRouting r = moe_route_sigmoid(logits, bias, k, groups, topk_groups, true, 2.5f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> s(experts), c(experts);
    for (int64_t e = 0; e < experts; ++e) {
      s[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(logits.data<float>()[t * experts + e])));
      c[e] = s[e] + bias.data<float>()[e];
    }
    std::vector<double> group(groups);  // groups of 2: the sum of both
    for (int64_t g = 0; g < groups; ++g) group[g] = c[2 * g] + c[2 * g + 1];
    std::vector<int> gorder(groups);
    std::iota(gorder.begin(), gorder.end(), 0);
    std::sort(gorder.begin(), gorder.end(), [&](int a1, int b1) { return group[a1] > group[b1]; });
    std::vector<int> allowed;
    for (int g : {gorder[0], gorder[1]}) allowed.insert(allowed.end(), {2 * g, 2 * g + 1});
    std::sort(allowed.begin(), allowed.end(), [&](int a1, int b1) { return c[a1] > c[b1]; });
    const double z = s[allowed[0]] + s[allowed[1]];
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(r.expert_ids.data<int32_t>()[t * k + j], allowed[j]) << "token " << t;
      EXPECT_NEAR(r.weights.data<float>()[t * k + j], 2.5 * s[allowed[j]] / z, 1e-5);
    }
  }
  for (const bool normalize : {true, false}) {
    SCOPED_TRACE(normalize ? "normalized" : "not normalized");
    MoeLayer m = random_layer(rng, 6, 5, experts, k, normalize);
    m.sigmoid = true;
    m.bias = bias;
    m.groups = groups;
    m.topk_groups = topk_groups;
    m.scaling = 2.5f;
    m.z = normalize ? 0.3f : 0.0f;  // the router z-loss of the logits, as Megatron's with any score function
    Tensor x = random_tensor({5, m.hidden}, rng), g_out = random_tensor({5, m.hidden}, rng);
    expect_backward_matches_finite_differences(m, x, g_out);
  }
}

// DeepSeek-V2's softmax routing: group-limited (groups ranked by their largest probability,
// transformers' group_limited_greedy) and scaled (routed_scaling_factor); then the layer's
// backward against finite differences.
TEST(OpsMoe, SoftmaxGroupLimitedScaledRouting) {
  Rng rng(75);
  const int64_t tokens = 6, experts = 8, k = 2, groups = 4, topk_groups = 2;
  Tensor logits = random_tensor({tokens, experts}, rng, 1.5);
  const MoeRouting r = moe_route_softmax(logits, k, groups, topk_groups, false, 16.0f);
  EXPECT_EQ(r.scaling, 16.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> p(experts);
    double sum = 0.0;
    for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(static_cast<double>(logits.data<float>()[t * experts + e]));
    for (double& v : p) v /= sum;
    std::vector<double> group(groups);  // groups of 2: the larger
    for (int64_t g = 0; g < groups; ++g) group[g] = std::max(p[2 * g], p[2 * g + 1]);
    std::vector<int> gorder(groups);
    std::iota(gorder.begin(), gorder.end(), 0);
    std::sort(gorder.begin(), gorder.end(), [&](int a1, int b1) { return group[a1] > group[b1]; });
    std::vector<int> allowed;
    for (int g : {gorder[0], gorder[1]}) allowed.insert(allowed.end(), {2 * g, 2 * g + 1});
    std::sort(allowed.begin(), allowed.end(), [&](int a1, int b1) { return p[a1] > p[b1]; });
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(r.expert_ids.data<int32_t>()[t * k + j], allowed[j]) << "token " << t;
      EXPECT_NEAR(r.weights.data<float>()[t * k + j], 16.0 * p[allowed[j]], 1e-5);
    }
  }
  expect_error([&] { moe_route_softmax(logits, 5, 4, 2, false, 1.0f); },
               {"moe_route: top-k 5 must be between 1 and the 4 experts of the 2 groups kept"});
  expect_error([&] { moe_route_softmax(logits, 2, 3, 1, false, 1.0f); }, {"8 experts in 3 groups"});
  for (const bool normalize : {true, false}) {
    SCOPED_TRACE(normalize ? "normalized" : "not normalized");
    MoeLayer m = random_layer(rng, 6, 5, experts, k, normalize);
    m.groups = groups;
    m.topk_groups = topk_groups;
    m.scaling = 2.5f;
    m.aux = 0.3f;  // the balancing loss's probability gradient joins the scaled weights'
    Tensor x = random_tensor({5, m.hidden}, rng), g_out = random_tensor({5, m.hidden}, rng);
    expect_backward_matches_finite_differences(m, x, g_out);
  }
}

TEST(OpsMoe, BalancingLossIsTransformersForm) {
  // Two tokens, two experts, top-1: token 0 picks expert 0 (p = 0.8), token 1 expert 1 (0.6).
  Tensor logits = Tensor::empty({2, 2});
  const float l0 = std::log(0.8f / 0.2f), l1 = std::log(0.6f / 0.4f);
  logits.data<float>()[0] = l0;
  logits.data<float>()[1] = 0.0f;
  logits.data<float>()[2] = 0.0f;
  logits.data<float>()[3] = l1;
  const MoeRouting r = moe_route(logits, 1, true);
  // E * sum_e f_e P_e = 2 * (0.5 * (0.8 + 0.4) / 2 + 0.5 * (0.2 + 0.6) / 2) = 1.0
  EXPECT_NEAR(moe_balancing_loss({&r}).loss, 1.0, 1e-6);
  // Over two layers' routings, the counts and probabilities pool: the same routing twice
  // gives the same loss, and each probability's gradient E f_e / N.
  const MoeBalance two = moe_balancing_loss({&r, &r});
  EXPECT_NEAR(two.loss, 1.0, 1e-6);
  EXPECT_NEAR(two.prob_gradient[0], 2.0 * 0.5 / 4.0, 1e-12);
}

// Megatron's global form (moe_switch_balancing_loss, NOTE [MoE routing]): the same routing
// with counts of 4 tokens, 3 to expert 0 and 1 to expert 1, E / (k T^2) sum_e c_e P_e =
// 2 / 16 x (3 x 1.2 + 1 x 0.8); with the routing's own counts over its own tokens it is
// Megatron's per-layer loss.
TEST(OpsMoe, GlobalBalancingLossTakesItsCountsFromElsewhere) {
  Tensor logits = Tensor::empty({2, 2});
  logits.data<float>()[0] = std::log(0.8f / 0.2f);
  logits.data<float>()[1] = 0.0f;
  logits.data<float>()[2] = 0.0f;
  logits.data<float>()[3] = std::log(0.6f / 0.4f);
  const MoeRouting r = moe_route(logits, 1, true);
  const MoeBalance b = moe_switch_balancing_loss(r, {3.0, 1.0}, 4.0);
  EXPECT_NEAR(b.loss, 2.0 / 16.0 * (3.0 * 1.2 + 1.0 * 0.8), 1e-6);
  ASSERT_EQ(b.prob_gradient.size(), 2u);
  EXPECT_DOUBLE_EQ(b.prob_gradient[0], 2.0 * 3.0 / 16.0);
  EXPECT_DOUBLE_EQ(b.prob_gradient[1], 2.0 * 1.0 / 16.0);

  Rng rng(75);
  const int64_t tokens = 11, experts = 6, k = 2;
  const MoeRouting random = moe_route(random_tensor({tokens, experts}, rng, 1.5), k, true);
  std::vector<double> own;
  for (int64_t c : moe_expert_counts(random).assigned) own.push_back(static_cast<double>(c));
  const MoeBalance global = moe_switch_balancing_loss(random, own, tokens),
                   per_layer = moe_grouped_balancing_loss(random, 1);
  EXPECT_NEAR(global.loss, per_layer.loss, 1e-12 * per_layer.loss);
  for (size_t e = 0; e < own.size(); ++e)
    EXPECT_NEAR(global.prob_gradient[e], per_layer.prob_gradient[e], 1e-15) << "expert " << e;

  expect_error([&] { moe_switch_balancing_loss(r, {3.0}, 4.0); },
               {"moe_switch_balancing_loss: 1 counts for 2 experts"});
  expect_error([&] { moe_switch_balancing_loss(r, {3.0, 1.0}, 1.0); }, {"fewer than the routing's 2"});
  const MoeRouting sig = moe_route_sigmoid(Tensor::zeros({3, 8}), Tensor(), 2, 1, 1, true, 1.0f);
  expect_error([&] { moe_switch_balancing_loss(sig, std::vector<double>(8, 1.0), 3.0); }, {"for softmax routing"});
}

// The global form's counts over a step (Megatron's global_tokens_per_expert / ga_steps): each
// micro-batch adds its counts and gets the average over the step's micro-batches so far; a
// reset starts a new step.
TEST(OpsMoe, StepCountsAverageTheStepsMicroBatches) {
  MoeStepCounts counts;
  EXPECT_EQ(counts.add({2, 4}), (std::vector<double>{2.0, 4.0}));
  EXPECT_EQ(counts.add({4, 0}), (std::vector<double>{3.0, 2.0}));
  EXPECT_EQ(counts.add({0, 5}), (std::vector<double>{2.0, 3.0}));
  EXPECT_EQ(counts.micro_batches(), 3);
  expect_error([&] { counts.add({1, 2, 3}); }, {"MoeStepCounts: 3 counts after micro-batches of 2"});
  counts.reset();
  EXPECT_EQ(counts.micro_batches(), 0);
  EXPECT_EQ(counts.add({1, 1, 7}), (std::vector<double>{1.0, 1.0, 7.0}));
}

// The layer's backward with the global form's loss, its counts fixed (they take no gradient),
// against central finite differences.
TEST(OpsMoe, BackwardWithGlobalBalancingLossMatchesFiniteDifferences) {
  Rng rng(76);
  MoeLayer m = random_layer(rng, 6, 5, 4, 2, true);
  m.aux = 0.5f;
  m.aux_type = "global";
  m.tokens_per_expert = {9.0, 2.5, 4.0, 0.5};  // 16 assignments of 8 tokens, top-2
  m.total_tokens = 8.0;
  Tensor x = random_tensor({5, m.hidden}, rng), dout = random_tensor({5, m.hidden}, rng);
  expect_backward_matches_finite_differences(m, x, dout);
  Tensor zero = Tensor::zeros({5, m.hidden});  // the balancing loss's gradient alone
  expect_backward_matches_finite_differences(m, x, zero);
}

TEST(OpsMoe, RefusesBadInputs) {
  Tensor logits = Tensor::zeros({3, 4});
  expect_error([&] { moe_route(logits, 0, true); }, {"top-k 0 must be between 1 and the 4 experts"});
  expect_error([&] { moe_route(logits, 5, true); }, {"top-k 5 must be between 1 and the 4 experts"});
  const MoeRouting r = moe_route(logits, 2, true);
  Tensor x = Tensor::zeros({3, 8}), wrong = Tensor::zeros({5, 8});
  expect_error([&] { moe_permute(wrong, x, r); }, {"moe_permute permuted"});
  expect_error([&] { moe_combine(x, wrong, r, nullptr); }, {"moe_combine expert_out"});
  Tensor eight = Tensor::zeros({3, 8});
  expect_error([&] { moe_route_sigmoid(eight, Tensor(), 2, 3, 1, true, 1.0f); }, {"8 experts in 3 groups"});
  expect_error([&] { moe_route_sigmoid(eight, Tensor(), 5, 4, 2, true, 1.0f); },
               {"top-k 5 must be between 1 and the 4 experts of the 2 groups kept"});
  const MoeRouting sig = moe_route_sigmoid(eight, Tensor(), 2, 1, 1, true, 1.0f);
  expect_error([&] { moe_balancing_loss({&sig}); }, {"for softmax routing"});
  Tensor d_logits = Tensor::empty({3, 4}), d_weights = Tensor::zeros({3, 2}), three = Tensor::zeros({3});
  expect_error([&] { moe_route_backward(d_logits, d_weights, r, &three); }, {"moe_route_backward prob_gradient"});
}

// Buffers laid out by the caller (as the model's arena does; required on CUDA) receive the
// same routing as one the op allocates; a buffer of the wrong shape is refused by name.
TEST(OpsMoe, RoutesIntoGivenBuffers) {
  Rng rng(11);
  const int64_t tokens = 7, experts = 5, k = 2;
  Tensor logits = Tensor::empty({tokens, experts});
  for (int64_t i = 0; i < logits.numel(); ++i) logits.data<float>()[i] = static_cast<float>(rng.normal());
  const MoeRouting own = moe_route(logits, k, true);
  MoeRoutingBuffers buffers{Tensor::empty({tokens, experts}), Tensor::empty({tokens, k}, DType::I32),
                            Tensor::empty({tokens, k}), Tensor::empty({tokens * k}, DType::I32),
                            Tensor::empty({tokens * k}, DType::I32)};
  const MoeRouting given = moe_route(logits, k, true, buffers);
  EXPECT_EQ(given.expert_ids.raw(), buffers.expert_ids.raw());
  EXPECT_EQ(given.offsets, own.offsets);
  for (int64_t i = 0; i < tokens * k; ++i) {
    EXPECT_EQ(given.expert_ids.data<int32_t>()[i], own.expert_ids.data<int32_t>()[i]);
    EXPECT_EQ(given.weights.data<float>()[i], own.weights.data<float>()[i]);
    EXPECT_EQ(given.row_of.data<int32_t>()[i], own.row_of.data<int32_t>()[i]);
  }
  buffers.weights = Tensor::empty({tokens, k + 1});
  expect_error([&] { moe_route(logits, k, true, buffers); }, {"moe_route logits buffer weights"});
}

// NOTE [Routing bias update]: an expert above the mean load loses `rate`, one below gains it,
// one at the mean keeps its bias.
TEST(OpsMoe, RoutingBiasMovesTowardsTheMeanLoad) {
  Tensor bias = Tensor::empty({4});
  const float start[] = {0.5f, -0.25f, 0.0f, 1.0f};
  std::copy(start, start + 4, bias.data<float>());
  moe_update_routing_bias(bias, {10, 2, 6, 6}, 0.125);  // mean 6
  EXPECT_EQ(bias.data<float>()[0], 0.375f);
  EXPECT_EQ(bias.data<float>()[1], -0.125f);
  EXPECT_EQ(bias.data<float>()[2], 0.0f);
  EXPECT_EQ(bias.data<float>()[3], 1.0f);
  EXPECT_THROW(moe_update_routing_bias(bias, {1, 2, 3}, 0.1), Error);
}

}  // namespace
}  // namespace forge
