#include <gtest/gtest.h>

#include "expect_error.h"
#include "ops/embedding.h"
#include "ops_testing.h"
#include "vocab_parallel_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

Tensor token_tensor(const std::vector<int32_t>& ids) {
  Tensor t = Tensor::empty({static_cast<int64_t>(ids.size())}, DType::I32);
  std::copy(ids.begin(), ids.end(), t.data<int32_t>());
  return t;
}

TEST(OpsEmbedding, ForwardGathersRows) {
  Rng rng(41);
  int64_t vocab = 11, hidden = 7;
  Tensor table = random_tensor({vocab, hidden}, rng);
  Tensor tokens = token_tensor({3, 0, 10, 3, 5});
  Tensor out = Tensor::empty({5, hidden});
  embedding_forward(out, tokens, table);
  for (int64_t n = 0; n < 5; ++n) {
    for (int64_t h = 0; h < hidden; ++h) {
      EXPECT_EQ(out.data<float>()[n * hidden + h], table.data<float>()[tokens.data<int32_t>()[n] * hidden + h]);
    }
  }
}

TEST(OpsEmbedding, BackwardAccumulatesFiniteDifferenceGradients) {
  Rng rng(42);
  int64_t vocab = 6, hidden = 5;
  Tensor table = random_tensor({vocab, hidden}, rng);
  Tensor tokens = token_tensor({2, 2, 5, 0, 2, 5, 1});
  Tensor r = random_tensor({7, hidden}, rng);
  Tensor out = Tensor::empty({7, hidden});
  auto loss = [&] {
    embedding_forward(out, tokens, table);
    return testing::weighted_sum(out, r);
  };
  std::vector<double> fd = testing::finite_difference(table, loss);
  Tensor dtable = random_tensor({vocab, hidden}, rng);
  std::vector<double> added = testing::to_double(dtable);
  embedding_backward(dtable, r, tokens);
  std::vector<double> after = testing::to_double(dtable);
  for (size_t i = 0; i < added.size(); ++i) added[i] = after[i] - added[i];
  EXPECT_LT(relative_error(added, fd), 1e-4);
}

TEST(OpsEmbedding, BackwardIsDeterministic) {
  Rng rng(43);
  int64_t vocab = 300, hidden = 64, count = 2000;
  std::vector<int32_t> ids(count);
  for (auto& id : ids) id = static_cast<int32_t>(rng.below(17));
  Tensor tokens = token_tensor(ids), dout = random_tensor({count, hidden}, rng);
  Tensor a = Tensor::zeros({vocab, hidden}), b = Tensor::zeros({vocab, hidden});
  embedding_backward(a, dout, tokens);
  embedding_backward(b, dout, tokens);
  EXPECT_TRUE(testing::bitwise_equal(a, b));
}

TEST(OpsEmbedding, RejectsTokenOutsideVocabulary) {
  Tensor table = Tensor::zeros({4, 3}), out = Tensor::zeros({3, 3});
  for (int32_t bad : {4, -1}) {
    Tensor tokens = token_tensor({1, bad, 2});
    try {
      embedding_forward(out, tokens, table);
      FAIL() << "token " << bad << " was accepted";
    } catch (const Error& e) {
      std::string message = e.what();
      EXPECT_NE(message.find("position 1"), std::string::npos) << message;
      EXPECT_NE(message.find(std::to_string(bad)), std::string::npos) << message;
    }
    EXPECT_THROW(embedding_backward(table, out, tokens), Error);
  }
}

// Rows [begin, begin + size) of an fp32 table [V, H], as a new [size, H] table.
Tensor table_rows(const Tensor& table, int64_t begin, int64_t size) {
  return table.narrow(begin, begin + size).clone();
}

// NOTE [Vocabulary-parallel embedding]: the shards' lookups sum to the full lookup, and each
// shard's backward adds exactly the full backward's rows it holds, for shards of equal and
// unequal sizes (13 rows split 2 and 4 ways), ids in every shard, repeated ids.
TEST(OpsEmbedding, ShardsSumToTheFullLookupAndGradient) {
  Rng rng(44);
  const int64_t vocab = 13, hidden = 6;
  Tensor table = random_tensor({vocab, hidden}, rng);
  Tensor tokens = token_tensor({0, 12, 6, 3, 3, 9, 6, 1, 12, 7, 0});
  const int64_t count = tokens.numel();
  Tensor full = Tensor::empty({count, hidden});
  embedding_forward(full, tokens, table);
  Tensor dout = random_tensor({count, hidden}, rng), dtable0 = random_tensor({vocab, hidden}, rng);
  Tensor dtable = dtable0.clone();
  embedding_backward(dtable, dout, tokens);
  for (int64_t shards : {1, 2, 4}) {
    Tensor sum = Tensor::zeros({count, hidden});
    for (int64_t r = 0; r < shards; ++r) {
      const int64_t begin = testing::shard_begin(vocab, shards, r), size = testing::shard_size(vocab, shards, r);
      Tensor out = Tensor::empty({count, hidden});
      testing::fill_nan(out);
      embedding_shard_forward(out, tokens, table_rows(table, begin, size), begin, vocab);
      for (int64_t i = 0; i < sum.numel(); ++i) sum.data<float>()[i] += out.data<float>()[i];

      Tensor shard_grad = table_rows(dtable0, begin, size);
      embedding_shard_backward(shard_grad, dout, tokens, begin, vocab);
      EXPECT_TRUE(testing::bitwise_equal(shard_grad, table_rows(dtable, begin, size)))
          << "shard " << r << " of " << shards;
    }
    EXPECT_TRUE(testing::bitwise_equal(sum, full)) << shards << " shards";
  }
}

TEST(OpsEmbedding, ShardWritesZerosForIdsItDoesNotHold) {
  Tensor table = Tensor::empty({2, 3});
  std::fill_n(table.data<float>(), 6, 1.0f);
  Tensor tokens = token_tensor({4, 5, 6, 3});
  Tensor out = Tensor::empty({4, 3});
  testing::fill_nan(out);
  embedding_shard_forward(out, tokens, table, 4, 8);
  const float expected[] = {1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0};
  for (int i = 0; i < 12; ++i) EXPECT_EQ(out.data<float>()[i], expected[i]) << i;
}

TEST(OpsEmbedding, ShardRejectsTokensOutsideTheVocabularyAndShardsOutsideIt) {
  Tensor table = Tensor::zeros({4, 3}), out = Tensor::zeros({3, 3});
  for (int32_t bad : {8, -1}) {
    Tensor tokens = token_tensor({1, bad, 2});
    expect_error([&] { embedding_shard_forward(out, tokens, table, 4, 8); },
                 {"embedding_shard_forward", "token id " + std::to_string(bad), "position 1", "[0, 8)"});
    expect_error([&] { embedding_shard_backward(table, out, tokens, 4, 8); },
                 {"embedding_shard_backward", "token id " + std::to_string(bad), "position 1"});
  }
  Tensor tokens = token_tensor({1, 0, 2});
  expect_error([&] { embedding_shard_forward(out, tokens, table, 5, 8); }, {"rows [5, 9)", "[0, 8)"});
  expect_error([&] { embedding_shard_backward(table, out, tokens, -1, 8); }, {"rows [-1, 3)", "[0, 8)"});
  expect_error([&] { embedding_shard_forward(Tensor::zeros({3, 4}), tokens, table, 0, 8); },
               {"embedding_shard_forward out has shape [3, 4], expected [3, 3]"});
  expect_error([&] { embedding_shard_backward(table, out, Tensor::zeros({3}), 0, 8); },
               {"embedding_shard_backward tokens is f32, expected i32"});
}

}  // namespace
}  // namespace forge
