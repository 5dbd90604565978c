#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "expect_error.h"
#include "ops/flow_matching.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

Tensor times(std::vector<float> values) {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t.data<float>());
  return t;
}

TEST(OpsFlowMatching, PairMatchesTheFormula) {
  Rng rng(81);
  const int64_t batch = 3, tokens = 5, features = 7;
  Tensor x0 = random_tensor({batch, tokens, features}, rng), noise = random_tensor({batch, tokens, features}, rng);
  Tensor t = times({0.0f, 0.3125f, 1.0f});
  Tensor noisy = Tensor::empty(x0.shape()), target = Tensor::empty(x0.shape());
  testing::fill_nan(noisy);
  testing::fill_nan(target);
  flow_matching_pair(noisy, target, x0, noise, t);
  std::vector<double> want_noisy(x0.numel()), want_target(x0.numel());
  for (int64_t i = 0; i < x0.numel(); ++i) {
    const double tb = t.data<float>()[i / (tokens * features)], x = x0.data<float>()[i], z = noise.data<float>()[i];
    want_noisy[i] = (1.0 - tb) * x + tb * z;
    want_target[i] = z - x;
  }
  EXPECT_LT(relative_error(noisy, want_noisy), 1e-6);
  EXPECT_LT(relative_error(target, want_target), 1e-6);
  // t = 0 is the clean latent, t = 1 pure noise, exactly.
  const int64_t per_sample = tokens * features;
  for (int64_t i = 0; i < per_sample; ++i) {
    EXPECT_EQ(noisy.data<float>()[i], x0.data<float>()[i]);
    EXPECT_EQ(noisy.data<float>()[2 * per_sample + i], noise.data<float>()[2 * per_sample + i]);
  }
}

TEST(OpsFlowMatching, MseLossMatchesTheFormulaAndAccumulates) {
  Rng rng(82);
  Tensor pred = random_tensor({2, 6, 4}, rng), target = random_tensor({2, 6, 4}, rng);
  Tensor loss = times({0.5f}), dpred = Tensor::empty(pred.shape());
  testing::fill_nan(dpred);
  mse_loss(loss, dpred, pred, target, 0.25f);
  const double count = static_cast<double>(pred.numel());
  double sum = 0;
  std::vector<double> want_grad(pred.numel());
  for (int64_t i = 0; i < pred.numel(); ++i) {
    const double d = static_cast<double>(pred.data<float>()[i]) - target.data<float>()[i];
    sum += d * d;
    want_grad[i] = 2.0 * d / count * 0.25;
  }
  EXPECT_NEAR(loss.data<float>()[0], 0.5 + sum / count, 1e-6);
  EXPECT_LT(relative_error(dpred, want_grad), 1e-6);
  // A second micro-batch adds its mean: the step's loss is the sum over micro-batches.
  mse_loss(loss, dpred, pred, target, 0.25f);
  EXPECT_NEAR(loss.data<float>()[0], 0.5 + 2 * sum / count, 2e-6);
}

TEST(OpsFlowMatching, MseGradientMatchesFiniteDifferences) {
  Rng rng(83);
  Tensor pred = random_tensor({2, 3, 4}, rng), target = random_tensor({2, 3, 4}, rng);
  Tensor scratch = Tensor::empty(pred.shape());
  auto loss = [&] {
    Tensor l = times({0.0f});
    mse_loss(l, scratch, pred, target, 1.0f);
    return static_cast<double>(l.data<float>()[0]);
  };
  std::vector<double> fd = testing::finite_difference(pred, loss, 1e-2f);
  Tensor l = times({0.0f}), dpred = Tensor::empty(pred.shape());
  mse_loss(l, dpred, pred, target, 1.0f);
  EXPECT_LT(relative_error(dpred, fd), 1e-3);
}

TEST(OpsFlowMatching, RejectsBadShapesAndDtypes) {
  Tensor x0 = Tensor::zeros({2, 3, 4}), t = Tensor::zeros({2}), out = Tensor::zeros({2, 3, 4});
  expect_error([&] { flow_matching_pair(out, out, Tensor::zeros({6, 4}), Tensor::zeros({6, 4}), t); },
               {"flow_matching_pair", "x0", "[B, N, F]"});
  expect_error([&] { flow_matching_pair(out, out, x0, x0, Tensor::zeros({3})); }, {"flow_matching_pair t"});
  expect_error([&] { flow_matching_pair(out, Tensor::zeros({2, 3, 5}), x0, x0, t); }, {"flow_matching_pair target"});
  expect_error([&] { flow_matching_pair(out, out, x0, Tensor::zeros({2, 3, 4}, DType::BF16), t); },
               {"flow_matching_pair noise", "bf16"});
  Tensor loss = Tensor::zeros({1});
  expect_error([&] { mse_loss(Tensor::zeros({2}), out, x0, x0, 1.0f); }, {"mse_loss loss"});
  expect_error([&] { mse_loss(loss, out, x0, Tensor::zeros({2, 3, 3}), 1.0f); }, {"mse_loss target"});
  expect_error([&] { mse_loss(loss, Tensor::zeros({0}), Tensor::zeros({0}), Tensor::zeros({0}), 1.0f); },
               {"mse_loss", "no elements"});
  expect_error([&] { mse_loss(Tensor::zeros({1}, DType::BF16), out, x0, x0, 1.0f); }, {"mse_loss loss", "bf16"});
}

}  // namespace
}  // namespace forge
