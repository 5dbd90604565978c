// Dense attention (ops/dense_attention.h) on the CPU against the formula
// computed in double in the test, per (sample, head, query): scores scale q.k +
// bias, softmax, weighted sum of values. Shapes cover a bias and none, scale 1
// (T5) and 1/sqrt(d), more keys than queries and fewer, values of their own
// head dim, one head of 512 (the VAE's), and a single key. Also: every query
// row's weights sum to 1 (constant values come back unchanged), the bias is
// shared across samples, and bad shapes are refused naming the tensor.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/rng.h"
#include "expect_error.h"
#include "ops/dense_attention.h"

namespace forge {
namespace {

struct Dims {
  int64_t batch, q_len, kv_len, heads, head_dim, v_head_dim;
  bool bias;
  float scale;
};

Tensor random(const Shape& shape, Rng& rng, double scale = 1.0) {
  Tensor t = Tensor::empty(shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = static_cast<float>(scale * rng.normal());
  return t;
}

std::vector<double> reference(const Dims& d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor* bias) {
  std::vector<double> out(static_cast<size_t>(d.batch * d.q_len * d.heads * d.v_head_dim));
  std::vector<double> s(static_cast<size_t>(d.kv_len));
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t h = 0; h < d.heads; ++h)
      for (int64_t i = 0; i < d.q_len; ++i) {
        double max_s = -INFINITY, sum = 0.0;
        for (int64_t j = 0; j < d.kv_len; ++j) {
          double dot = 0.0;
          for (int64_t e = 0; e < d.head_dim; ++e)
            dot += static_cast<double>(q.data<float>()[((b * d.q_len + i) * d.heads + h) * d.head_dim + e]) *
                   k.data<float>()[((b * d.kv_len + j) * d.heads + h) * d.head_dim + e];
          s[j] = d.scale * dot + (bias ? bias->data<float>()[(h * d.q_len + i) * d.kv_len + j] : 0.0);
          max_s = std::max(max_s, s[j]);
        }
        for (double& x : s) sum += x = std::exp(x - max_s);
        for (int64_t e = 0; e < d.v_head_dim; ++e) {
          double acc = 0.0;
          for (int64_t j = 0; j < d.kv_len; ++j)
            acc += s[j] * v.data<float>()[((b * d.kv_len + j) * d.heads + h) * d.v_head_dim + e];
          out[((b * d.q_len + i) * d.heads + h) * d.v_head_dim + e] = acc / sum;
        }
      }
  return out;
}

TEST(OpsDenseAttention, MatchesFormula) {
  const Dims cases[] = {
      {2, 7, 7, 3, 8, 8, true, 1.0f},                           // T5: bias, no scaling
      {1, 5, 13, 2, 6, 10, true, 0.5f},                         // more keys, values of their own width
      {3, 9, 4, 1, 16, 16, false, 0.25f},                       // fewer keys, no bias
      {1, 6, 6, 1, 512, 512, false, 1.0f / std::sqrt(512.0f)},  // the VAE's one head of 512
      {2, 3, 1, 2, 4, 4, true, 1.0f},                           // one key: its value, whatever the scores
  };
  Rng rng(17);
  for (const Dims& d : cases) {
    Tensor q = random({d.batch, d.q_len, d.heads, d.head_dim}, rng);
    Tensor k = random({d.batch, d.kv_len, d.heads, d.head_dim}, rng);
    Tensor v = random({d.batch, d.kv_len, d.heads, d.v_head_dim}, rng);
    Tensor bias = random({d.heads, d.q_len, d.kv_len}, rng, 2.0);
    Tensor out = Tensor::empty({d.batch, d.q_len, d.heads, d.v_head_dim});
    dense_attention_forward(out, q, k, v, d.bias ? &bias : nullptr, d.scale);
    const std::vector<double> want = reference(d, q, k, v, d.bias ? &bias : nullptr);
    for (int64_t i = 0; i < out.numel(); ++i)
      ASSERT_NEAR(out.data<float>()[i], want[static_cast<size_t>(i)], 2e-5 * (1.0 + std::abs(want[i])))
          << "element " << i << " of case " << d.batch << "x" << d.q_len << "x" << d.kv_len << "x" << d.heads << "x"
          << d.head_dim;
  }
}

TEST(OpsDenseAttention, RowsAreWeightedAverages) {
  // Values constant along the keys come back unchanged: each row's weights sum
  // to 1, even with large scores and a large bias (the maximum is taken out
  // before exp).
  Rng rng(3);
  const int64_t b = 2, l = 11, h = 2, dk = 4;
  Tensor q = random({b, l, h, dk}, rng, 30.0), k = random({b, l, h, dk}, rng, 30.0);
  Tensor bias = random({h, l, l}, rng, 50.0);
  Tensor v = Tensor::empty({b, l, h, 3});
  for (int64_t i = 0; i < v.numel(); ++i) v.data<float>()[i] = static_cast<float>(i % 3) - 1.5f;
  Tensor out = Tensor::empty({b, l, h, 3});
  dense_attention_forward(out, q, k, v, &bias, 1.0f);
  for (int64_t i = 0; i < out.numel(); ++i) EXPECT_NEAR(out.data<float>()[i], static_cast<float>(i % 3) - 1.5f, 1e-5);
}

TEST(OpsDenseAttention, BiasIsSharedAcrossTheBatch) {
  Rng rng(5);
  const int64_t l = 6, h = 3, dk = 5;
  Tensor q = random({1, l, h, dk}, rng), k = random({1, l, h, dk}, rng), v = random({1, l, h, dk}, rng);
  Tensor bias = random({h, l, l}, rng);
  Tensor q2 = Tensor::empty({2, l, h, dk}), k2 = Tensor::empty({2, l, h, dk}), v2 = Tensor::empty({2, l, h, dk});
  for (auto [two, one] : {std::pair{&q2, &q}, std::pair{&k2, &k}, std::pair{&v2, &v}}) {
    two->narrow(0, 1).copy_from(*one);
    two->narrow(1, 2).copy_from(*one);
  }
  Tensor out = Tensor::empty({1, l, h, dk}), out2 = Tensor::empty({2, l, h, dk});
  dense_attention_forward(out, q, k, v, &bias, 1.0f);
  dense_attention_forward(out2, q2, k2, v2, &bias, 1.0f);
  for (int64_t s = 0; s < 2; ++s)
    for (int64_t i = 0; i < out.numel(); ++i) EXPECT_EQ(out2.data<float>()[s * out.numel() + i], out.data<float>()[i]);
}

TEST(OpsDenseAttention, RefusesBadShapes) {
  Tensor q = Tensor::zeros({1, 4, 2, 8}), k = Tensor::zeros({1, 5, 2, 8}), v = Tensor::zeros({1, 5, 2, 8});
  Tensor out = Tensor::zeros({1, 4, 2, 8});
  Tensor bias = Tensor::zeros({2, 4, 4});
  expect_error([&] { dense_attention_forward(out, q, k, v, &bias, 1.0f); }, {"dense_attention_forward bias"});
  expect_error(
      [&] {
        dense_attention_forward(out, q, Tensor::zeros({1, 5, 2, 7}), v, nullptr, 1.0f);
      },
      {"dense_attention_forward k"});
  expect_error(
      [&] {
        dense_attention_forward(Tensor::zeros({1, 4, 2, 9}), q, k, v, nullptr, 1.0f);
      },
      {"dense_attention_forward out"});
  expect_error(
      [&] {
        dense_attention_forward(out, q, Tensor::zeros({1, 0, 2, 8}), Tensor::zeros({1, 0, 2, 8}), nullptr, 1.0f);
      },
      {"no keys to attend to"});
  expect_error([&] { dense_attention_forward(out, q.view({4, 2, 8}), k, v, nullptr, 1.0f); }, {"must be [B, L, H, D]"});
}

}  // namespace
}  // namespace forge
