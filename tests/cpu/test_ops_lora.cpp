// LoRA on the linear op (ops/lora.h, NOTE [LoRA linear]): a fused projection's adapter
// equals its parts' separate low-rank updates, its gradients are the ones finite
// differences see (b's outside each part's rows stay zero), with and without dropout; the
// dropout mask is deterministic in its seed, keeps about 1 - p of the elements, and the
// backward sees the mask the forward drew.
#include <gtest/gtest.h>

#include "core/rng.h"
#include "ops/linear.h"
#include "ops/lora.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::finite_difference;
using testing::random_tensor;
using testing::relative_error;
using testing::weighted_sum;

constexpr int64_t kTokens = 5, kIn = 6, kOut = 7, kRank = 2;

struct Fixture {
  Rng rng{7};
  Tensor x = random_tensor({kTokens, kIn}, rng), w = random_tensor({kOut, kIn}, rng);
  Tensor a = random_tensor({2 * kRank, kIn}, rng), b = random_tensor({kOut, 2 * kRank}, rng);
  Tensor r = random_tensor({kTokens, kOut}, rng);  // d loss / d y
  LoraWorkspace workspace{Tensor::zeros({2 * kRank * kTokens}), Tensor::zeros({2 * kRank * kTokens}),
                          Tensor::zeros({kTokens * kIn})};
  LoraAdapter adapter;

  explicit Fixture(float dropout) {
    adapter.a = a;
    adapter.b = b;
    adapter.grad_a = Tensor::zeros(a.shape());
    adapter.grad_b = Tensor::zeros(b.shape());
    adapter.rank = kRank;
    adapter.scale = 1.5f;
    adapter.dropout = dropout;
    adapter.dropout_seed = 99;
    adapter.parts = {{0, 3}, {4, 7}};  // row 3 is not adapted
    adapter.workspace = &workspace;
    lora_mask_blocks(b, kRank, adapter.parts);  // b holds each part's B only
  }
  LinearWeight weight() const { return {w, &adapter}; }
  double loss() {
    Tensor y = Tensor::empty({kTokens, kOut});
    linear_forward(y, x, weight());
    return weighted_sum(y, r);
  }
};

// y = x W^T + scale * sum over parts k of dropout_k(x) A_k^T B_k^T in B_k's rows, in double.
std::vector<double> reference_forward(const Fixture& f) {
  std::vector<double> y(kTokens * kOut, 0.0);
  for (int64_t n = 0; n < kTokens; ++n)
    for (int64_t o = 0; o < kOut; ++o)
      for (int64_t i = 0; i < kIn; ++i) y[n * kOut + o] += double(f.x.data<float>()[n * kIn + i]) * f.w.data<float>()[o * kIn + i];
  for (size_t k = 0; k < f.adapter.parts.size(); ++k) {
    Tensor dropped = f.x.clone();
    if (f.adapter.dropout > 0.0f) lora_dropout(dropped, f.x, f.adapter.dropout, derive_seed(99, k), false);
    for (int64_t n = 0; n < kTokens; ++n)
      for (int64_t o = f.adapter.parts[k].begin; o < f.adapter.parts[k].end; ++o) {
        double s = 0.0;
        for (int64_t c = 0; c < kRank; ++c) {
          double u = 0.0;
          for (int64_t i = 0; i < kIn; ++i)
            u += double(dropped.data<float>()[n * kIn + i]) * f.a.data<float>()[(k * kRank + c) * kIn + i];
          s += u * f.b.data<float>()[o * 2 * kRank + k * kRank + c];
        }
        y[n * kOut + o] += 1.5 * s;
      }
  }
  return y;
}

class OpsLora : public ::testing::TestWithParam<float> {};

TEST_P(OpsLora, ForwardIsEachPartsSeparateUpdate) {
  Fixture f(GetParam());
  Tensor y = Tensor::empty({kTokens, kOut});
  testing::fill_nan(y);
  linear_forward(y, f.x, f.weight());
  EXPECT_LT(relative_error(y, reference_forward(f)), 1e-6);
}

TEST_P(OpsLora, GradientsMatchFiniteDifferences) {
  Fixture f(GetParam());
  Tensor dx = Tensor::empty({kTokens, kIn});
  linear_backward_input(dx, f.r, f.weight());
  EXPECT_LT(relative_error(dx, finite_difference(f.x, [&] { return f.loss(); })), 2e-3) << "dx";

  const LinearWeight grad{Tensor(), &f.adapter};  // frozen weight: no dW
  linear_backward_weight(grad, f.r, f.x, true);
  EXPECT_LT(relative_error(f.adapter.grad_a, finite_difference(f.a, [&] { return f.loss(); })), 2e-3) << "da";
  std::vector<double> db = finite_difference(f.b, [&] { return f.loss(); });
  for (int64_t o = 0; o < kOut; ++o)
    for (int64_t c = 0; c < 2 * kRank; ++c) {
      const LoraPartRows& p = f.adapter.parts[static_cast<size_t>(c / kRank)];
      if (o < p.begin || o >= p.end) db[o * 2 * kRank + c] = 0.0;  // not a parameter of the part
    }
  EXPECT_LT(relative_error(f.adapter.grad_b, db), 2e-3) << "db";

  // A second micro-batch adds.
  const std::vector<double> once = testing::to_double(f.adapter.grad_a);
  linear_backward_weight(grad, f.r, f.x, false);
  std::vector<double> twice(once.size());
  for (size_t i = 0; i < once.size(); ++i) twice[i] = 2.0 * once[i];
  EXPECT_LT(relative_error(f.adapter.grad_a, twice), 1e-6);
}

// NOTE [LoRA row views]: the projection run as two GEMMs on row ranges [0, 5) and [5, 7)
// (the second range cutting the second part) computes what the whole adapter computes:
// the outputs, the input gradient summed over the ranges (linear_backward_input_add), A's
// gradient summed (the later view adds even when told to overwrite) and B's in its rows.
TEST_P(OpsLora, RowViewsAddUpToTheWholeAdapter) {
  Fixture f(GetParam());
  Rng rng(5);
  const int64_t split = 5;
  const Tensor r1 = random_tensor({kTokens, split}, rng), r2 = random_tensor({kTokens, kOut - split}, rng);
  Tensor r = Tensor::empty({kTokens, kOut});
  for (int64_t n = 0; n < kTokens; ++n)
    for (int64_t o = 0; o < kOut; ++o)
      r.data<float>()[n * kOut + o] =
          o < split ? r1.data<float>()[n * split + o] : r2.data<float>()[n * (kOut - split) + o - split];
  Tensor y = Tensor::empty({kTokens, kOut}), dx = Tensor::empty({kTokens, kIn});
  linear_forward(y, f.x, f.weight());
  linear_backward_input(dx, r, f.weight());
  linear_backward_weight({Tensor(), &f.adapter}, r, f.x, true);
  const Tensor grad_a = f.adapter.grad_a.clone(), grad_b = f.adapter.grad_b.clone();

  const LoraAdapter first = lora_rows(f.adapter, 0, split, false), second = lora_rows(f.adapter, split, kOut, true);
  EXPECT_EQ(second.parts[0].begin, 0);  // part 0 (rows [0, 3)) lies before the range
  EXPECT_EQ(second.parts[0].end, 0);
  EXPECT_EQ(second.parts[1].begin, 0);  // part 1 (rows [4, 7)) from the range's start
  EXPECT_EQ(second.parts[1].end, kOut - split);
  const LinearWeight w1{f.w.narrow(0, split), &first}, w2{f.w.narrow(split, kOut), &second};
  Tensor y1 = Tensor::empty({kTokens, split}), y2 = Tensor::empty({kTokens, kOut - split});
  linear_forward(y1, f.x, w1);
  linear_forward(y2, f.x, w2);
  for (int64_t n = 0; n < kTokens; ++n)
    for (int64_t o = 0; o < kOut; ++o) {
      const float got = o < split ? y1.data<float>()[n * split + o] : y2.data<float>()[n * (kOut - split) + o - split];
      EXPECT_NEAR(got, y.data<float>()[n * kOut + o], 1e-5f) << n << ", " << o;
    }
  Tensor dx_rows = Tensor::zeros({kTokens, kIn});
  linear_backward_input_add(dx_rows, r1, w1);
  linear_backward_input_add(dx_rows, r2, w2);
  EXPECT_LT(relative_error(dx_rows, testing::to_double(dx)), 1e-5);
  f.adapter.grad_a.fill_zero();
  f.adapter.grad_b.fill_zero();
  for (int micro_batch = 0; micro_batch < 2; ++micro_batch) {  // the second adds to the first
    linear_backward_weight({Tensor(), &first}, r1, f.x, micro_batch == 0);
    linear_backward_weight({Tensor(), &second}, r2, f.x, micro_batch == 0);
  }
  std::vector<double> twice_a = testing::to_double(grad_a), twice_b = testing::to_double(grad_b);
  for (double& v : twice_a) v *= 2.0;
  for (double& v : twice_b) v *= 2.0;
  EXPECT_LT(relative_error(f.adapter.grad_a, twice_a), 1e-5);
  EXPECT_LT(relative_error(f.adapter.grad_b, twice_b), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Dropout, OpsLora, ::testing::Values(0.0f, 0.3f));

TEST(OpsLoraDropout, DeterministicInItsSeedAndKeepsOneMinusP) {
  Rng rng(3);
  const Tensor in = random_tensor({1000, 10}, rng);
  Tensor first = Tensor::empty(in.shape()), second = Tensor::empty(in.shape()), other = Tensor::empty(in.shape());
  lora_dropout(first, in, 0.25f, 11, false);
  lora_dropout(second, in, 0.25f, 11, false);
  lora_dropout(other, in, 0.25f, 12, false);
  EXPECT_TRUE(testing::bitwise_equal(first, second));
  EXPECT_FALSE(testing::bitwise_equal(first, other));
  int64_t kept = 0;
  for (int64_t i = 0; i < in.numel(); ++i) {
    const float v = first.data<float>()[i];
    if (v != 0.0f) {
      ++kept;
      EXPECT_FLOAT_EQ(v, in.data<float>()[i] / 0.75f);
    }
  }
  EXPECT_NEAR(static_cast<double>(kept) / static_cast<double>(in.numel()), 0.75, 0.02);
  // Accumulating adds the same dropped values.
  Tensor sum = first.clone();
  lora_dropout(sum, in, 0.25f, 11, true);
  for (int64_t i = 0; i < in.numel(); ++i) EXPECT_EQ(sum.data<float>()[i], 2.0f * first.data<float>()[i]);
  // p = 0 keeps everything unchanged.
  lora_dropout(other, in, 0.0f, 11, false);
  EXPECT_TRUE(testing::bitwise_equal(other, in));
}

}  // namespace
}  // namespace forge
