// TokenSampler: greedy picks the first largest logit; sampling draws from softmax(logits/T)
// restricted by top-k and top-p as transformers restricts it; the same seed gives the same
// draws; bad options are refused naming the command-line option.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "expect_error.h"
#include "train/token_sampler.h"

namespace forge {
namespace {

std::vector<double> frequencies(const SamplingOptions& options, const std::vector<float>& logits, int draws) {
  TokenSampler sampler(options);
  std::vector<double> counts(logits.size(), 0.0);
  for (int i = 0; i < draws; ++i) counts[static_cast<size_t>(sampler.next(logits))] += 1.0 / draws;
  return counts;
}

const std::vector<float> kLogits = {std::log(0.2f), std::log(0.5f), std::log(0.3f)};

TEST(TokenSampler, GreedyTakesTheFirstLargest) {
  TokenSampler greedy(SamplingOptions{});
  EXPECT_EQ(greedy.next(kLogits), 1);
  const std::vector<float> tie = {0.0f, 2.0f, -1.0f, 2.0f};
  EXPECT_EQ(greedy.next(tie), 1);
}

TEST(TokenSampler, SamplesTheSoftmax) {
  const std::vector<double> f = frequencies({.temperature = 1.0, .seed = 1}, kLogits, 40000);
  EXPECT_NEAR(f[0], 0.2, 0.01);
  EXPECT_NEAR(f[1], 0.5, 0.01);
  EXPECT_NEAR(f[2], 0.3, 0.01);
  // Temperature 0.5 squares the probabilities before renormalizing: .04, .25, .09 over .38.
  const std::vector<double> cold = frequencies({.temperature = 0.5, .seed = 2}, kLogits, 40000);
  EXPECT_NEAR(cold[1], 0.25 / 0.38, 0.01);
}

TEST(TokenSampler, TopKAndTopPKeepTheMostLikely) {
  for (const SamplingOptions& o : {SamplingOptions{.temperature = 1.0, .top_k = 2, .seed = 3},
                                   SamplingOptions{.temperature = 1.0, .top_p = 0.75, .seed = 3}}) {
    const std::vector<double> f = frequencies(o, kLogits, 40000);
    EXPECT_EQ(f[0], 0.0);
    EXPECT_NEAR(f[1], 0.5 / 0.8, 0.01);
  }
  // top-p 0.81 needs the third token too; top-p below the largest probability keeps one.
  EXPECT_GT(frequencies({.temperature = 1.0, .top_p = 0.81, .seed = 4}, kLogits, 4000)[0], 0.1);
  EXPECT_NEAR(frequencies({.temperature = 1.0, .top_p = 0.4, .seed = 4}, kLogits, 1000)[1], 1.0, 1e-9);
  EXPECT_NEAR(frequencies({.temperature = 3.0, .top_k = 1, .seed = 4}, kLogits, 1000)[1], 1.0, 1e-9);
}

TEST(TokenSampler, SameSeedSameDraws) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(i * 1.7));
  TokenSampler a({.temperature = 0.9, .top_p = 0.95, .seed = 11}), b({.temperature = 0.9, .top_p = 0.95, .seed = 11});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(a.next(logits), b.next(logits));
}

TEST(TokenSampler, BadOptionsAreRefused) {
  expect_error([] { validate_sampling({.temperature = -0.5}); }, {"--temperature -0.5", ">= 0"});
  expect_error([] { validate_sampling({.temperature = NAN}); }, {"--temperature"});
  expect_error([] { validate_sampling({.temperature = 1.0, .top_k = -1}); }, {"--top-k -1"});
  expect_error([] { validate_sampling({.temperature = 1.0, .top_p = 0.0}); }, {"--top-p 0", "(0, 1]"});
  expect_error([] { validate_sampling({.temperature = 1.0, .top_p = 1.5}); }, {"--top-p 1.5"});
  expect_error([] { validate_sampling({.top_p = 0.9}); }, {"give --temperature > 0"});
  expect_error([] { validate_sampling({.top_k = 5}); }, {"give --temperature > 0"});
  TokenSampler greedy(SamplingOptions{});
  const std::vector<float> nan_logits = {0.0f, NAN};
  expect_error([&] { greedy.next(nan_logits); }, {"token 1 is NaN"});
}

}  // namespace
}  // namespace forge
