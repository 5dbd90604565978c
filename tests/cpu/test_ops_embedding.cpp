#include <gtest/gtest.h>

#include "ops/embedding.h"
#include "ops_testing.h"

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

}  // namespace
}  // namespace forge
