#include <gtest/gtest.h>

#include <cmath>

#include "ops/cross_entropy.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

constexpr int32_t kIgnore = -100;

Tensor target_tensor(const std::vector<int32_t>& ids) {
  Tensor t = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::I32);
  std::copy(ids.begin(), ids.end(), t.data<int32_t>());
  return t;
}

std::vector<double> naive_losses(const Tensor& logits, const Tensor& targets) {
  int64_t rows = logits.dim(0), vocab = logits.dim(1);
  const float* x = logits.data<float>();
  std::vector<double> losses(rows);
  for (int64_t n = 0; n < rows; ++n) {
    int32_t t = targets.data<int32_t>()[n];
    if (t == kIgnore) continue;
    double m = x[n * vocab];
    for (int64_t v = 0; v < vocab; ++v) m = std::max(m, static_cast<double>(x[n * vocab + v]));
    double s = 0.0;
    for (int64_t v = 0; v < vocab; ++v) s += std::exp(x[n * vocab + v] - m);
    losses[n] = m + std::log(s) - x[n * vocab + t];
  }
  return losses;
}

TEST(OpsCrossEntropy, ForwardMatchesDoublePrecision) {
  Rng rng(51);
  Tensor logits = random_tensor({6, 37}, rng, 4.0);
  Tensor targets = target_tensor({0, 36, kIgnore, 5, 17, kIgnore});
  Tensor losses = Tensor::empty({6});
  cross_entropy_forward_backward(losses, Tensor(), logits, targets, kIgnore, 1.0f);
  EXPECT_LT(relative_error(losses, naive_losses(logits, targets)), 1e-5);
  EXPECT_EQ(losses.data<float>()[2], 0.0f);
  EXPECT_EQ(losses.data<float>()[5], 0.0f);
}

TEST(OpsCrossEntropy, LargeLogitsStayFinite) {
  Tensor logits = Tensor::empty({1, 3});
  const float values[] = {1000.0f, -1000.0f, 999.0f};
  std::copy(values, values + 3, logits.data<float>());
  Tensor targets = target_tensor({2}), losses = Tensor::empty({1}), dlogits = Tensor::empty({1, 3});
  cross_entropy_forward_backward(losses, dlogits, logits, targets, kIgnore, 1.0f);
  EXPECT_NEAR(losses.data<float>()[0], std::log1p(std::exp(1.0)), 1e-4);
  for (int v = 0; v < 3; ++v) EXPECT_TRUE(std::isfinite(dlogits.data<float>()[v]));
}

TEST(OpsCrossEntropy, GradientMatchesFiniteDifferences) {
  Rng rng(52);
  const float grad_scale = 0.37f;
  Tensor logits = random_tensor({5, 9}, rng, 2.0);
  Tensor targets = target_tensor({8, kIgnore, 0, 4, 4});
  Tensor losses = Tensor::empty({5});
  auto loss = [&] {
    cross_entropy_forward_backward(losses, Tensor(), logits, targets, kIgnore, grad_scale);
    double s = 0.0;
    for (int64_t n = 0; n < 5; ++n) s += losses.data<float>()[n];
    return grad_scale * s;
  };
  std::vector<double> fd = testing::finite_difference(logits, loss, 1e-3f);
  Tensor dlogits = Tensor::empty({5, 9});
  std::fill_n(dlogits.data<float>(), dlogits.numel(), 7.0f);
  cross_entropy_forward_backward(losses, dlogits, logits, targets, kIgnore, grad_scale);
  EXPECT_LT(relative_error(dlogits, fd), 1e-2);
  for (int64_t v = 0; v < 9; ++v) EXPECT_EQ(dlogits.data<float>()[9 + v], 0.0f) << "ignored row, column " << v;
}

TEST(OpsCrossEntropy, GradientMayOverwriteLogits) {
  Rng rng(53);
  Tensor logits = random_tensor({4, 33}, rng, 3.0);
  Tensor targets = target_tensor({32, 1, kIgnore, 0});
  Tensor losses_separate = Tensor::empty({4}), dlogits = Tensor::empty({4, 33});
  cross_entropy_forward_backward(losses_separate, dlogits, logits, targets, kIgnore, 0.5f);
  Tensor losses_aliased = Tensor::empty({4});
  cross_entropy_forward_backward(losses_aliased, logits, logits, targets, kIgnore, 0.5f);
  EXPECT_TRUE(testing::bitwise_equal(losses_separate, losses_aliased));
  EXPECT_TRUE(testing::bitwise_equal(dlogits, logits));
}

TEST(OpsCrossEntropy, IsDeterministic) {
  Rng rng(54);
  Tensor logits = random_tensor({200, 257}, rng);
  std::vector<int32_t> ids(200);
  for (auto& id : ids) id = static_cast<int32_t>(rng.below(257));
  Tensor targets = target_tensor(ids);
  Tensor l1 = Tensor::empty({200}), l2 = Tensor::empty({200});
  Tensor d1 = Tensor::empty({200, 257}), d2 = Tensor::empty({200, 257});
  cross_entropy_forward_backward(l1, d1, logits, targets, kIgnore, 1.0f);
  cross_entropy_forward_backward(l2, d2, logits, targets, kIgnore, 1.0f);
  EXPECT_TRUE(testing::bitwise_equal(l1, l2));
  EXPECT_TRUE(testing::bitwise_equal(d1, d2));
}

TEST(OpsCrossEntropy, RejectsTargetOutsideVocabulary) {
  Tensor logits = Tensor::zeros({3, 5}), losses = Tensor::empty({3});
  for (int32_t bad : {5, -1, 1000}) {
    Tensor targets = target_tensor({0, kIgnore, bad});
    try {
      cross_entropy_forward_backward(losses, Tensor(), logits, targets, kIgnore, 1.0f);
      FAIL() << "target " << bad << " was accepted";
    } catch (const Error& e) {
      std::string message = e.what();
      EXPECT_NE(message.find("row 2"), std::string::npos) << message;
      EXPECT_NE(message.find(std::to_string(bad)), std::string::npos) << message;
    }
  }
}

}  // namespace
}  // namespace forge
