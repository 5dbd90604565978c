// Token dropping in the MoE ops (NOTE [MoE capacity] in ops/moe.h) on the CPU:
//  - a hand-built routing with an overloaded expert (a tie at its capacity's edge), an
//    expert within its capacity and an empty one, under both policies, with and without
//    padding: which assignments are kept, the layout (offsets, source, row_of), the counts
//    before and after the drop, and what the permutation, the combine and its backward do
//    with dropped assignments and padding rows;
//  - the capacity as Megatron's get_capacity computes it;
//  - a whole MoE layer's backward with dropping active against central finite differences
//    (inputs whose choices and drops are far from ties);
//  - bad settings refused.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "expect_error.h"
#include "moe_testing.h"
#include "ops/moe.h"
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

std::vector<int32_t> ints(const Tensor& t) { return {t.data<int32_t>(), t.data<int32_t>() + t.numel()}; }

// Six tokens, four experts, top-1, weights the probabilities (not renormalized, which would
// make every top-1 weight 1). Expert 0 is chosen by tokens 0-3: token 1 with the largest
// probability, tokens 2 and 3 with equal ones (equal rows), token 0 with the smallest;
// expert 1 by token 4, expert 2 by token 5, expert 3 by none. Factor 1: capacity
// ceil(6 x 1 / 4) = 2.
Tensor hand_built_logits() {
  const float rows[6][4] = {{1.5f, 0, 0, -30}, {4, 0, 0, -30}, {2, 0, 0, -30},
                            {2, 0, 0, -30},    {0, 3, 0, -30}, {0, 0, 2, -30}};
  Tensor logits = Tensor::empty({6, 4});
  for (int t = 0; t < 6; ++t) std::copy(rows[t], rows[t] + 4, logits.data<float>() + t * 4);
  return logits;
}

TEST(OpsMoeCapacity, CapacityIsMegatronsGetCapacity) {
  // ceil((tokens * k / experts) * factor), no minimum.
  EXPECT_EQ((MoeCapacity{1.0}).capacity(6, 1, 4), 2);
  EXPECT_EQ((MoeCapacity{0.5}).capacity(16, 2, 4), 4);
  EXPECT_EQ((MoeCapacity{1.25}).capacity(16, 2, 4), 10);
  EXPECT_EQ((MoeCapacity{0.01}).capacity(16, 2, 4), 1);
  EXPECT_EQ((MoeCapacity{1.0}).capacity(0, 2, 4), 0);
  EXPECT_EQ((MoeCapacity{0.0}).capacity(16, 2, 4), 0);  // dropless
  EXPECT_EQ((MoeCapacity{1.25, false, true}).permuted_rows(16, 2, 4), 40);
  EXPECT_EQ((MoeCapacity{1.25, false, false}).permuted_rows(16, 2, 4), 32);
}

TEST(OpsMoeCapacity, ProbsKeepsTheLargestWeightsTiesToTheEarlierToken) {
  const MoeRouting r = moe_route(hand_built_logits(), 1, /*normalize=*/false, {}, MoeCapacity{1.0});
  ASSERT_EQ(r.capacity, 2);
  EXPECT_TRUE(r.dropping);
  EXPECT_EQ(ints(r.expert_ids), (std::vector<int32_t>{0, 0, 0, 0, 1, 2}));
  // Expert 0 keeps token 1 (largest) and token 2 (tied with 3, earlier); drops 0 and 3.
  EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 2, 3, 4, 4}));
  EXPECT_EQ(ints(r.source), (std::vector<int32_t>{1, 2, 4, 5, -1, -1}));
  EXPECT_EQ(ints(r.row_of), (std::vector<int32_t>{-1, 0, 1, -1, 2, 3}));
  const MoeCounts counts = moe_expert_counts(r);
  EXPECT_EQ(counts.assigned, (std::vector<int64_t>{4, 1, 1, 0}));
  EXPECT_EQ(counts.kept, (std::vector<int64_t>{2, 1, 1, 0}));
  // The weights stay the router's (not renormalized, the dropped ones too).
  EXPECT_EQ(r.weights.data<float>()[2], r.weights.data<float>()[3]);
  EXPECT_GT(r.weights.data<float>()[0], 0.0f);
}

TEST(OpsMoeCapacity, PositionKeepsTheFirstInTokenOrder) {
  const MoeRouting r = moe_route(hand_built_logits(), 1, false, {}, MoeCapacity{1.0, /*by_position=*/true});
  EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 2, 3, 4, 4}));
  EXPECT_EQ(ints(r.source), (std::vector<int32_t>{0, 1, 4, 5, -1, -1}));
  EXPECT_EQ(ints(r.row_of), (std::vector<int32_t>{0, 1, -1, -1, 2, 3}));
}

TEST(OpsMoeCapacity, PaddingGivesEveryExpertItsCapacity) {
  const MoeRouting r = moe_route(hand_built_logits(), 1, false, {}, MoeCapacity{1.0, false, /*pad=*/true});
  EXPECT_EQ(r.permuted_rows(), 8);
  EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 2, 4, 6, 8}));
  EXPECT_EQ(ints(r.source), (std::vector<int32_t>{1, 2, 4, -1, 5, -1, -1, -1}));
  EXPECT_EQ(ints(r.row_of), (std::vector<int32_t>{-1, 0, 1, -1, 2, 4}));
  EXPECT_EQ(moe_expert_counts(r).kept, (std::vector<int64_t>{2, 1, 1, 0}));

  // Padding rows are zero input; dropped tokens get the residual alone; the combine's
  // backward writes padding rows as zeros and dropped weights' gradients as 0.
  const int64_t hidden = 3;
  Rng rng(5);
  Tensor x = random_tensor({6, hidden}, rng), permuted = Tensor::empty({8, hidden});
  std::fill_n(permuted.data<float>(), permuted.numel(), std::nanf(""));
  moe_permute(permuted, x, r);
  for (int64_t row = 0; row < 8; ++row)
    for (int64_t h = 0; h < hidden; ++h) {
      const int32_t a = r.source.data<int32_t>()[row];
      EXPECT_EQ(permuted.data<float>()[row * hidden + h], a < 0 ? 0.0f : x.data<float>()[a * hidden + h]);
    }
  Tensor expert_out = random_tensor({8, hidden}, rng), out = Tensor::empty({6, hidden});
  moe_combine(out, expert_out, r, &x);
  for (int64_t t = 0; t < 6; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      const int32_t row = r.row_of.data<int32_t>()[t];
      const float want = x.data<float>()[t * hidden + h] +
                         (row < 0 ? 0.0f : r.weights.data<float>()[t] * expert_out.data<float>()[row * hidden + h]);
      EXPECT_FLOAT_EQ(out.data<float>()[t * hidden + h], want) << "token " << t;
    }
  Tensor dout = random_tensor({6, hidden}, rng), d_expert_out = Tensor::empty({8, hidden});
  Tensor d_weights = Tensor::empty({6, 1});
  std::fill_n(d_expert_out.data<float>(), d_expert_out.numel(), std::nanf(""));
  moe_combine_backward(d_expert_out, d_weights, dout, expert_out, r);
  for (int64_t row : {3, 5, 6, 7})
    for (int64_t h = 0; h < hidden; ++h) EXPECT_EQ(d_expert_out.data<float>()[row * hidden + h], 0.0f);
  EXPECT_EQ(d_weights.data<float>()[0], 0.0f);
  EXPECT_EQ(d_weights.data<float>()[3], 0.0f);
  EXPECT_NE(d_weights.data<float>()[1], 0.0f);
  Tensor dx = Tensor::empty({6, hidden});
  moe_permute_backward(dx, d_expert_out, r);
  for (int64_t h = 0; h < hidden; ++h) {
    EXPECT_EQ(dx.data<float>()[0 * hidden + h], 0.0f);  // dropped: no gradient through the experts
    EXPECT_EQ(dx.data<float>()[1 * hidden + h], d_expert_out.data<float>()[0 * hidden + h]);
  }
}

TEST(OpsMoeCapacity, ALargeCapacityDropsNothing) {
  Rng rng(9);
  const Tensor logits = random_tensor({10, 4}, rng, 2.0);
  const MoeRouting dropless = moe_route(logits, 2, true);
  for (const bool pad : {false, true}) {
    const MoeRouting r = moe_route(logits, 2, true, {}, MoeCapacity{4.0, false, pad});
    EXPECT_EQ(r.capacity, 20);  // more than the 10 tokens
    EXPECT_EQ(moe_expert_counts(r).kept, moe_expert_counts(dropless).kept);
    for (int64_t a = 0; a < 20; ++a) EXPECT_GE(r.row_of.data<int32_t>()[a], 0);
    if (!pad) EXPECT_EQ(ints(r.source), ints(dropless.source));
  }
}

// The smallest gap, over every token, between its k-th and (k+1)-th probability, and over
// every expert above its capacity, between its capacity-th and next weight (probs policy).
double routing_margin(const MoeRouting& r, bool by_position) {
  double margin = INFINITY;
  for (int64_t t = 0; t < r.tokens; ++t) {
    std::vector<float> p(r.probs.data<float>() + t * r.experts, r.probs.data<float>() + (t + 1) * r.experts);
    std::sort(p.begin(), p.end(), std::greater<float>());
    margin = std::min<double>(margin, p[static_cast<size_t>(r.k - 1)] - p[static_cast<size_t>(r.k)]);
  }
  if (by_position) return margin;
  for (int64_t e = 0; e < r.experts; ++e) {
    std::vector<float> w;
    for (int64_t a = 0; a < r.tokens * r.k; ++a)
      if (r.expert_ids.data<int32_t>()[a] == e) w.push_back(r.weights.data<float>()[a]);
    if (static_cast<int64_t>(w.size()) <= r.capacity) continue;
    std::sort(w.begin(), w.end(), std::greater<float>());
    margin = std::min<double>(margin, w[static_cast<size_t>(r.capacity - 1)] - w[static_cast<size_t>(r.capacity)]);
  }
  return margin;
}

TEST(OpsMoeCapacity, BackwardWithDroppingMatchesFiniteDifferences) {
  for (const bool by_position : {false, true})
    for (const bool pad : {false, true})
      for (const float aux : {0.0f, 0.5f}) {
        SCOPED_TRACE(::testing::Message() << (by_position ? "position" : "probs") << (pad ? ", padded" : "")
                                          << ", aux " << aux);
        // The first seed whose routing drops something and whose choices and drops are far
        // from ties: central differences of 1e-3 move the probabilities by far less than the
        // margin, so no choice or drop changes between the two sides.
        const int64_t hidden = 6, ffn = 5, experts = 4, k = 2, tokens = 8;
        std::optional<MoeLayer> layer;
        Tensor x, dout;
        MoeActivations a;
        for (uint64_t seed = 300; !layer && seed < 400; ++seed) {
          Rng rng(seed);
          MoeLayer m{hidden,
                     ffn,
                     experts,
                     k,
                     true,
                     random_tensor({experts, hidden}, rng, 0.7),
                     random_tensor({experts, 2 * ffn, hidden}, rng, 0.4),
                     random_tensor({experts, hidden, ffn}, rng, 0.4)};
          m.aux = aux;
          m.capacity = {0.5, by_position, pad};  // capacity ceil(8 x 2 / 4 x 0.5) = 2 of 4 on average
          x = random_tensor({tokens, hidden}, rng);
          dout = random_tensor({tokens, hidden}, rng);
          moe_forward(m, x, a);
          int64_t kept = 0;
          for (int64_t n : moe_expert_counts(a.routing).kept) kept += n;
          if (kept < tokens * k && routing_margin(a.routing, by_position) > 5e-3) layer = std::move(m);
        }
        ASSERT_TRUE(layer) << "no seed gives a routing far from ties";
        MoeLayer& m = *layer;
        ASSERT_EQ(a.routing.capacity, 2);
        auto loss = [&] {
          MoeActivations b;
          const Tensor out = moe_forward(m, x, b);
          return testing::weighted_sum(out, dout) +
                 (m.aux != 0.0f ? m.aux * moe_balancing_loss({&b.routing}).loss : 0.0);
        };
        const MoeGrads g = moe_backward(m, x, a, dout);
        EXPECT_LT(relative_error(g.dx, finite_difference(x, loss, 1e-3f)), 1e-2);
        EXPECT_LT(relative_error(g.router, finite_difference(m.router, loss, 1e-3f)), 1e-2);
        EXPECT_LT(relative_error(g.gate_up, finite_difference(m.gate_up, loss, 1e-3f)), 1e-2);
        EXPECT_LT(relative_error(g.down, finite_difference(m.down, loss, 1e-3f)), 1e-2);
      }
}

TEST(OpsMoeCapacity, RefusesBadSettings) {
  const Tensor logits = Tensor::zeros({3, 4});
  expect_error([&] { moe_route(logits, 2, true, {}, MoeCapacity{0.0, false, true}); },
               {"capacity factor 0 (0: dropless) with padding true"});
  expect_error([&] { moe_route(logits, 2, true, {}, MoeCapacity{-1.0}); }, {"capacity factor -1"});
}

}  // namespace
}  // namespace forge
