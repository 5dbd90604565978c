// Mock and synthetic sources: determinism, and the synthetic entropy floor against
// brute-force enumeration and against the empirical entropy of a long generated stream.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <vector>

#include "core/error.h"
#include "data/dataset.h"
#include "data/generated_datasets.h"
#include "data/markov_source.h"

namespace forge {
namespace {

std::vector<int32_t> sample_of(const TokenDataset& dataset, int64_t index) {
  std::vector<int32_t> out(static_cast<size_t>(dataset.seq_len() + 1));
  dataset.sample(0, index, out.data());
  return out;
}

TEST(DataMock, DeterministicPerSeedSplitAndIndex) {
  DataConfig config;
  config.source = "mock";
  auto a = make_dataset(config, Split::Train, 16, 50, 7);
  auto b = make_dataset(config, Split::Train, 16, 50, 7);
  auto other_seed = make_dataset(config, Split::Train, 16, 50, 8);
  auto validation = make_dataset(config, Split::Validation, 16, 50, 7);
  EXPECT_EQ(a->num_samples(), int64_t{1} << 40);
  EXPECT_EQ(sample_of(*a, 3), sample_of(*b, 3));
  EXPECT_EQ(sample_of(*a, 1000000007), sample_of(*b, 1000000007));
  EXPECT_NE(sample_of(*a, 3), sample_of(*a, 4));
  EXPECT_NE(sample_of(*a, 3), sample_of(*other_seed, 3));
  EXPECT_NE(sample_of(*a, 3), sample_of(*validation, 3));
  for (int32_t token : sample_of(*a, 5)) EXPECT_TRUE(token >= 0 && token < 50);
  EXPECT_NEAR(a->entropy_floor(), std::log(50.0), 1e-12);
}

TEST(DataMock, NumSamplesFromConfig) {
  DataConfig config;
  config.source = "mock";
  config.num_samples = 123;
  EXPECT_EQ(make_dataset(config, Split::Train, 8, 10, 1)->num_samples(), 123);
}

// Exact mean floor over the seq_len targets of a sample by enumerating every sequence
// of seq_len + 1 tokens: (H(X_0..X_L) - H(X_0)) / L.
double brute_force_floor(const MarkovSource& source, int64_t seq_len) {
  const int64_t V = source.vocab_size(), k = source.order();
  int64_t total = 1;
  for (int64_t i = 0; i <= seq_len; ++i) total *= V;
  double joint = 0.0;
  std::vector<double> first(static_cast<size_t>(V), 0.0);
  std::vector<int64_t> x(static_cast<size_t>(seq_len + 1));
  for (int64_t code = 0; code < total; ++code) {
    int64_t c = code;
    for (int64_t i = seq_len; i >= 0; --i, c /= V) x[i] = c % V;
    int64_t ctx = 0;
    for (int64_t i = 0; i < k; ++i) ctx = ctx * V + x[i];
    double p = source.stationary(ctx);
    for (int64_t i = k; i <= seq_len; ++i) {
      p *= source.transition(ctx, x[i]);
      ctx = (ctx * V + x[i]) % source.num_contexts();
    }
    if (p > 0) joint -= p * std::log(p);
    first[x[0]] += p;
  }
  double h0 = 0.0;
  for (double p : first)
    if (p > 0) h0 -= p * std::log(p);
  return (joint - h0) / static_cast<double>(seq_len);
}

TEST(DataSynthetic, OrderOneFloorMatchesClosedForm) {
  // P rows for contexts 0, 1, 2. Stationary pi solves pi P = pi; solved by hand:
  // pi = (a, b, c) with the balance equations below.
  std::vector<double> P = {0.5, 0.25, 0.25,  //
                           0.1, 0.8, 0.1,    //
                           0.3, 0.3, 0.4};
  MarkovSource source(3, 1, P);
  // Solve pi (P - I) = 0, sum pi = 1 by Cramer's rule on two balance equations.
  // Equations: -0.5a + 0.1b + 0.3c = 0 ; 0.25a - 0.2b + 0.3c = 0 ; a + b + c = 1.
  double m[3][4] = {{-0.5, 0.1, 0.3, 0}, {0.25, -0.2, 0.3, 0}, {1, 1, 1, 1}};
  for (int col = 0; col < 3; ++col)
    for (int row = 0; row < 3; ++row)
      if (row != col) {
        double f = m[row][col] / m[col][col];
        for (int j = 0; j < 4; ++j) m[row][j] -= f * m[col][j];
      }
  double pi[3] = {m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]};
  double rate = 0.0;
  for (int ctx = 0; ctx < 3; ++ctx) {
    EXPECT_NEAR(source.stationary(ctx), pi[ctx], 1e-12);
    for (int v = 0; v < 3; ++v) rate -= pi[ctx] * P[ctx * 3 + v] * std::log(P[ctx * 3 + v]);
  }
  EXPECT_NEAR(source.entropy_rate(), rate, 1e-12);
  // Order 1: every target sees its full context, so the per-sample floor is the rate.
  EXPECT_NEAR(source.sample_entropy_floor(5), rate, 1e-12);
  EXPECT_NEAR(brute_force_floor(source, 5), rate, 1e-12);
}

TEST(DataSynthetic, OrderTwoFloorMatchesEnumeration) {
  MarkovSource source(3, 2, 0.3, 11);
  for (int64_t seq_len : {1, 2, 3, 6}) {
    EXPECT_NEAR(source.sample_entropy_floor(seq_len), brute_force_floor(source, seq_len), 1e-10)
        << "seq_len " << seq_len;
  }
  // Targets before position k are harder, so the per-sample floor exceeds the rate and
  // approaches it as samples grow.
  EXPECT_GT(source.sample_entropy_floor(6), source.entropy_rate());
  EXPECT_LT(source.sample_entropy_floor(1000) - source.entropy_rate(),
            source.sample_entropy_floor(6) - source.entropy_rate());
}

TEST(DataSynthetic, EmpiricalConditionalEntropyMatchesRate) {
  DataConfig config;  // synthetic, order 2
  const int64_t vocab = 8, seq_len = 256;
  auto dataset = make_dataset(config, Split::Train, seq_len, vocab, 3);
  const auto& source = static_cast<const SyntheticDataset&>(*dataset).source();
  std::map<int64_t, std::vector<int64_t>> counts;
  int64_t transitions = 0;
  for (int64_t index = 0; index < 4000; ++index) {
    std::vector<int32_t> s = sample_of(*dataset, index);
    for (int64_t t = 2; t <= seq_len; ++t) {
      auto& row = counts[s[t - 2] * vocab + s[t - 1]];
      row.resize(static_cast<size_t>(vocab));
      ++row[s[t]];
      ++transitions;
    }
  }
  double empirical = 0.0;
  for (const auto& [ctx, row] : counts) {
    int64_t n = 0;
    for (int64_t c : row) n += c;
    for (int64_t c : row)
      if (c > 0) empirical -= static_cast<double>(c) / transitions * std::log(static_cast<double>(c) / n);
  }
  EXPECT_NEAR(empirical, source.entropy_rate(), 0.01);
  EXPECT_GT(source.entropy_rate(), 0.1);
  EXPECT_LT(source.entropy_rate(), std::log(8.0) - 0.3);
  EXPECT_NEAR(dataset->entropy_floor(), data_entropy_floor(config, seq_len, vocab, 3), 1e-15);
}

TEST(DataSynthetic, DeterministicAndSplitsDiffer) {
  DataConfig config;
  auto a = make_dataset(config, Split::Train, 32, 64, 5);
  auto b = make_dataset(config, Split::Train, 32, 64, 5);
  auto validation = make_dataset(config, Split::Validation, 32, 64, 5);
  EXPECT_EQ(sample_of(*a, 9), sample_of(*b, 9));
  EXPECT_NE(sample_of(*a, 9), sample_of(*validation, 9));
  EXPECT_EQ(a->entropy_floor(), validation->entropy_floor());
  EXPECT_GT(a->entropy_floor(), 0.0);
  EXPECT_LT(a->entropy_floor(), std::log(64.0));
}

TEST(DataSynthetic, DefaultFloorsSitWellBelowUniform) {
  DataConfig config;
  for (int64_t vocab : {64, 128, 256}) {
    double floor = data_entropy_floor(config, 128, vocab, 42);
    EXPECT_GT(floor, 0.5) << vocab;
    EXPECT_LT(floor, 0.75 * std::log(static_cast<double>(vocab))) << vocab;
  }
}

TEST(DataSynthetic, RejectsTooManyContexts) {
  DataConfig config;
  config.synthetic_order = 4;
  try {
    make_dataset(config, Split::Train, 16, 256, 1);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("data.synthetic_order"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge
