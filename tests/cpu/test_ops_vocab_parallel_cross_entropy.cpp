// The three phases of NOTE [Vocabulary-parallel cross-entropy], run on every shard of T
// with the group's all-reduces done on the host, against cross_entropy_forward_backward
// over the full logits.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "expect_error.h"
#include "ops/cross_entropy.h"
#include "ops/vocab_parallel_cross_entropy.h"
#include "ops_testing.h"
#include "vocab_parallel_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

// The shards' sums of exp are rounded to fp32 before the all-reduce, so lse can round to
// the neighbouring fp32 value of the unsharded one (measured: under 2e-7 relative here).
constexpr double kTolerance = 1e-6;

Tensor target_tensor(const std::vector<int32_t>& ids) {
  Tensor t = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::I32);
  std::copy(ids.begin(), ids.end(), t.data<int32_t>());
  return t;
}

// Targets for rows of `vocab` classes split `shards` ways: the first and last class of every
// shard, then random classes, every third row ignored.
Tensor spread_targets(int64_t rows, int64_t vocab, int64_t shards, Rng& rng) {
  std::vector<int32_t> ids;
  for (int64_t r = 0; r < shards; ++r) {
    ids.push_back(static_cast<int32_t>(testing::shard_begin(vocab, shards, r)));
    ids.push_back(static_cast<int32_t>(testing::shard_begin(vocab, shards, r + 1) - 1));
  }
  while (static_cast<int64_t>(ids.size()) < rows) ids.push_back(static_cast<int32_t>(rng.below(vocab)));
  ids.resize(rows);
  for (int64_t n = 2; n < rows; n += 3) ids[n] = kIgnoreIndex;
  return target_tensor(ids);
}

struct ShardedResult {
  std::vector<Tensor> losses;  // each rank's
  Tensor dlogits;              // the ranks' gradients put side by side, [N, V]
};

// Every rank's three phases with the all-reduces between them. In place: each rank's
// gradient overwrites its logits; without a gradient, only the losses.
enum class Gradient { Separate, InPlace, None };

ShardedResult run_sharded(const Tensor& logits, const Tensor& targets, int64_t shards, float grad_scale,
                          Gradient gradient) {
  const int64_t rows = logits.dim(0), vocab = logits.dim(1);
  std::vector<Tensor> shard_logits, row_max, sums;
  for (int64_t r = 0; r < shards; ++r) {
    shard_logits.push_back(testing::shard_columns(logits, testing::shard_begin(vocab, shards, r),
                                                  testing::shard_size(vocab, shards, r)));
    row_max.push_back(Tensor::empty({rows}));
    testing::fill_nan(row_max.back());
    vocab_parallel_cross_entropy_max(row_max.back(), shard_logits.back());
  }
  testing::all_reduce_max(row_max);
  for (int64_t r = 0; r < shards; ++r) {
    sums.push_back(Tensor::empty({2, rows}));
    testing::fill_nan(sums.back());
    vocab_parallel_cross_entropy_sums(sums.back(), shard_logits[r], row_max[r], targets,
                                      testing::shard_begin(vocab, shards, r), kIgnoreIndex);
  }
  testing::all_reduce_sum(sums);
  ShardedResult result{{}, Tensor::empty({rows, vocab})};
  testing::fill_nan(result.dlogits);
  for (int64_t r = 0; r < shards; ++r) {
    const Tensor& x = shard_logits[r];
    Tensor dx = gradient == Gradient::InPlace ? x : Tensor();
    if (gradient == Gradient::Separate) {
      dx = Tensor::empty(x.shape());
      testing::fill_nan(dx);
    }
    result.losses.push_back(Tensor::empty({rows}));
    testing::fill_nan(result.losses.back());
    vocab_parallel_cross_entropy_finish(result.losses.back(), dx, x, row_max[r], sums[r], targets,
                                        testing::shard_begin(vocab, shards, r), kIgnoreIndex, grad_scale);
    if (dx.defined()) testing::put_columns(result.dlogits, dx, testing::shard_begin(vocab, shards, r));
  }
  return result;
}

TEST(OpsVocabParallelCrossEntropy, ShardsMatchCrossEntropyOverFullLogits) {
  Rng rng(61);
  const float grad_scale = 0.37f;
  for (int64_t vocab : {44, 37, 301}) {
    for (int64_t shards : {1, 2, 4}) {
      const int64_t rows = 13;
      Tensor logits = random_tensor({rows, vocab}, rng, 3.0);
      Tensor targets = spread_targets(rows, vocab, shards, rng);
      Tensor losses = Tensor::empty({rows}), dlogits = Tensor::empty({rows, vocab});
      cross_entropy_forward_backward(losses, dlogits, logits, targets, kIgnoreIndex, grad_scale);
      const std::string where = "vocab " + std::to_string(vocab) + ", " + std::to_string(shards) + " shards";

      ShardedResult separate = run_sharded(logits, targets, shards, grad_scale, Gradient::Separate);
      for (const Tensor& rank_losses : separate.losses) {
        EXPECT_LT(relative_error(rank_losses, testing::to_double(losses)), kTolerance) << where;
        EXPECT_TRUE(testing::bitwise_equal(rank_losses, separate.losses[0])) << "ranks' losses differ: " << where;
      }
      EXPECT_LT(relative_error(separate.dlogits, testing::to_double(dlogits)), kTolerance) << where;
      for (int64_t n = 2; n < rows; n += 3) {
        EXPECT_EQ(separate.losses[0].data<float>()[n], 0.0f) << "ignored row " << n << ": " << where;
        for (int64_t v = 0; v < vocab; ++v)
          ASSERT_EQ(separate.dlogits.data<float>()[n * vocab + v], 0.0f) << "ignored row " << n << ": " << where;
      }

      ShardedResult in_place = run_sharded(logits, targets, shards, grad_scale, Gradient::InPlace);
      EXPECT_TRUE(testing::bitwise_equal(in_place.losses[0], separate.losses[0])) << where;
      EXPECT_TRUE(testing::bitwise_equal(in_place.dlogits, separate.dlogits)) << where;
      ShardedResult loss_only = run_sharded(logits, targets, shards, grad_scale, Gradient::None);
      EXPECT_TRUE(testing::bitwise_equal(loss_only.losses[0], separate.losses[0])) << where;
    }
  }
}

TEST(OpsVocabParallelCrossEntropy, SumsHoldTheShardsPartsAndZerosOnIgnoredRows) {
  Tensor logits = Tensor::empty({3, 4});
  const float values[] = {0.0f, 1.0f, 2.0f, 3.0f, 5.0f, 5.0f, 5.0f, 5.0f, 9.0f, 8.0f, 7.0f, 6.0f};
  std::copy(values, values + 12, logits.data<float>());
  // The shard holds columns [10, 14) of a larger vocabulary; row 1 is ignored, row 2's
  // target is in another shard.
  Tensor targets = target_tensor({12, kIgnoreIndex, 3});
  Tensor row_max = Tensor::empty({3}), sums = Tensor::empty({2, 3});
  vocab_parallel_cross_entropy_max(row_max, logits);
  EXPECT_EQ(row_max.data<float>()[0], 3.0f);
  EXPECT_EQ(row_max.data<float>()[1], 5.0f);
  EXPECT_EQ(row_max.data<float>()[2], 9.0f);
  vocab_parallel_cross_entropy_sums(sums, logits, row_max, targets, 10, kIgnoreIndex);
  const float* s = sums.data<float>();
  EXPECT_NEAR(s[0], 1.0 + std::exp(-1.0) + std::exp(-2.0) + std::exp(-3.0), 1e-6);
  EXPECT_EQ(s[1], 0.0f);
  EXPECT_NEAR(s[2], 1.0 + std::exp(-1.0) + std::exp(-2.0) + std::exp(-3.0), 1e-6);
  EXPECT_EQ(s[3], 2.0f) << "the target's logit, column 12 - 10";
  EXPECT_EQ(s[4], 0.0f) << "ignored";
  EXPECT_EQ(s[5], 0.0f) << "the target is in another shard";
}

TEST(OpsVocabParallelCrossEntropy, LargeLogitsStayFinite) {
  Tensor logits = Tensor::empty({1, 4});
  const float values[] = {1000.0f, -1000.0f, 999.0f, -3.0e38f};
  std::copy(values, values + 4, logits.data<float>());
  Tensor targets = target_tensor({2});
  ShardedResult result = run_sharded(logits, targets, 2, 1.0f, Gradient::Separate);
  EXPECT_NEAR(result.losses[1].data<float>()[0], std::log1p(std::exp(1.0)), 1e-4);
  for (int v = 0; v < 4; ++v) EXPECT_TRUE(std::isfinite(result.dlogits.data<float>()[v])) << v;
}

TEST(OpsVocabParallelCrossEntropy, RejectsNegativeTargets) {
  Tensor logits = Tensor::zeros({3, 5}), row_max = Tensor::zeros({3}), sums = Tensor::zeros({2, 3});
  Tensor losses = Tensor::empty({3}), targets = target_tensor({0, kIgnoreIndex, -1});
  expect_error([&] { vocab_parallel_cross_entropy_sums(sums, logits, row_max, targets, 5, kIgnoreIndex); },
               {"vocab_parallel_cross_entropy_sums", "target -1", "row 2"});
  expect_error(
      [&] {
        vocab_parallel_cross_entropy_finish(losses, Tensor(), logits, row_max, sums, targets, 5, kIgnoreIndex, 1.0f);
      },
      {"vocab_parallel_cross_entropy_finish", "target -1", "row 2"});
  // A target past this shard (another rank's class) is not an error.
  Tensor elsewhere = target_tensor({0, 7, 1000});
  vocab_parallel_cross_entropy_sums(sums, logits, row_max, elsewhere, 0, kIgnoreIndex);
}

TEST(OpsVocabParallelCrossEntropy, RejectsBadShapesAndDtypes) {
  const int64_t rows = 3, vocab = 5;
  const Tensor logits = Tensor::zeros({rows, vocab}), row_max = Tensor::zeros({rows}), sums = Tensor::zeros({2, rows});
  const Tensor losses = Tensor::empty({rows}), targets = target_tensor({0, 1, kIgnoreIndex});
  auto max = [&](const Tensor& m, const Tensor& x) { vocab_parallel_cross_entropy_max(m, x); };
  auto sum = [&](const Tensor& s, const Tensor& x, const Tensor& m, const Tensor& t, int64_t begin) {
    vocab_parallel_cross_entropy_sums(s, x, m, t, begin, kIgnoreIndex);
  };
  auto finish = [&](const Tensor& l, const Tensor& d, const Tensor& x, const Tensor& s, const Tensor& t) {
    vocab_parallel_cross_entropy_finish(l, d, x, row_max, s, t, 0, kIgnoreIndex, 1.0f);
  };
  expect_error([&] { max(row_max, Tensor::zeros({vocab})); }, {"logits [5] must be [N, Vs]"});
  expect_error([&] { max(row_max, Tensor::zeros({rows, 0})); }, {"have no classes"});
  expect_error([&] { max(Tensor::zeros({rows + 1}), logits); }, {"row_max has shape [4]"});
  expect_error([&] { max(row_max, Tensor::zeros({rows, vocab}, DType::BF16)); }, {"logits is bf16, expected f32"});
  expect_error([&] { max(Tensor::zeros({rows}, DType::BF16), logits); }, {"row_max is bf16"});
  expect_error([&] { sum(Tensor::zeros({rows}), logits, row_max, targets, 0); },
               {"sums has shape [3], expected [2, 3]"});
  expect_error([&] { sum(sums, logits, Tensor::zeros({rows - 1}), targets, 0); }, {"row_max has shape [2]"});
  expect_error([&] { sum(sums, logits, row_max, target_tensor({0, 1}), 0); }, {"targets has shape [2]"});
  expect_error([&] { sum(sums, logits, row_max, Tensor::zeros({rows}), 0); }, {"targets is f32, expected i32"});
  expect_error([&] { sum(sums, logits, row_max, targets, -1); }, {"first column -1 is negative"});
  expect_error([&] { finish(Tensor::empty({rows, 1}), Tensor(), logits, sums, targets); }, {"losses has shape [3, 1]"});
  expect_error([&] { finish(losses, Tensor::empty({rows, vocab + 1}), logits, sums, targets); },
               {"dlogits has shape [3, 6]"});
  expect_error([&] { finish(losses, Tensor::empty({rows, vocab}, DType::BF16), logits, sums, targets); },
               {"dlogits is bf16"});
  expect_error([&] { finish(losses, Tensor(), logits, Tensor::zeros({rows, 2}), targets); },
               {"sums has shape [3, 2], expected [2, 3]"});
}

}  // namespace
}  // namespace forge
