// The affine LayerNorm (ops/layer_norm.h) against the formula in double: rows around a large
// mean (the two-pass variance), dims from 1 up, any leading shape, in place, and refusals.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "expect_error.h"
#include "ops/layer_norm.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

std::vector<double> reference(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  const int64_t dim = x.dim(-1), rows = x.numel() / dim;
  std::vector<double> y(static_cast<size_t>(x.numel()));
  const float* px = x.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0, squares = 0.0;
    for (int64_t d = 0; d < dim; ++d) sum += px[r * dim + d];
    const double mean = sum / dim;
    for (int64_t d = 0; d < dim; ++d) squares += (px[r * dim + d] - mean) * (px[r * dim + d] - mean);
    const double rstd = 1.0 / std::sqrt(squares / dim + eps);
    for (int64_t d = 0; d < dim; ++d)
      y[r * dim + d] = (px[r * dim + d] - mean) * rstd * weight.data<float>()[d] + bias.data<float>()[d];
  }
  return y;
}

TEST(OpsLayerNorm, ForwardMatchesDoublePrecision) {
  Rng rng(61);
  for (const Shape& shape : {Shape{1}, Shape{1, 5}, Shape{3, 7}, Shape{2, 3, 64}, Shape{4, 77, 96}}) {
    Tensor x = random_tensor(shape, rng);
    for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] += 40.0f;  // a mean to take out
    Tensor weight = random_tensor({shape.back()}, rng), bias = random_tensor({shape.back()}, rng);
    Tensor y = Tensor::empty(shape);
    testing::fill_nan(y);
    layer_norm_forward(y, x, weight, bias, 1e-5f);
    EXPECT_LT(relative_error(y, reference(x, weight, bias, 1e-5)), 1e-5) << shape_str(shape);
  }
}

TEST(OpsLayerNorm, InPlaceGivesTheSameValues) {
  Rng rng(62);
  Tensor x = random_tensor({5, 24}, rng, 3.0), weight = random_tensor({24}, rng), bias = random_tensor({24}, rng);
  Tensor y = Tensor::empty({5, 24});
  layer_norm_forward(y, x, weight, bias, 1e-6f);
  layer_norm_forward(x, x, weight, bias, 1e-6f);
  EXPECT_TRUE(testing::bitwise_equal(x, y));
}

TEST(OpsLayerNorm, ConstantRowGivesTheBias) {
  Tensor x = Tensor::empty({2, 6}), weight = Tensor::empty({6}), bias = Tensor::empty({6}), y = Tensor::empty({2, 6});
  for (int64_t i = 0; i < 12; ++i) x.data<float>()[i] = 3.5f;
  for (int64_t d = 0; d < 6; ++d) weight.data<float>()[d] = 2.0f, bias.data<float>()[d] = 0.25f * d;
  layer_norm_forward(y, x, weight, bias, 1e-5f);
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(y.data<float>()[i], 0.25f * (i % 6)) << i;
}

TEST(OpsLayerNorm, RejectsBadShapesAndDtypes) {
  Tensor x = Tensor::zeros({3, 8}), w = Tensor::zeros({8}), b = Tensor::zeros({8});
  expect_error([&] { layer_norm_forward(Tensor::zeros({3, 7}), x, w, b, 1e-5f); }, {"layer_norm_forward y"});
  expect_error([&] { layer_norm_forward(Tensor::zeros({3, 8}), x, Tensor::zeros({7}), b, 1e-5f); },
               {"layer_norm_forward weight"});
  expect_error([&] { layer_norm_forward(Tensor::zeros({3, 8}), x, w, Tensor::zeros({9}), 1e-5f); },
               {"layer_norm_forward bias"});
  expect_error([&] { layer_norm_forward(Tensor::zeros({3, 8}, DType::BF16), x, w, b, 1e-5f); },
               {"layer_norm_forward y", "bf16"});
  expect_error([&] { layer_norm_forward(Tensor::zeros({3, 8}), x, w, b, -1.0f); }, {"eps"});
}

}  // namespace
}  // namespace forge
