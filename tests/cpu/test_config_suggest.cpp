// Edit distance and did-you-mean suggestions.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "cli/config_suggest.h"

namespace forge {
namespace {

TEST(ConfigSuggest, EditDistanceCountsTranspositionsAsOneEdit) {
  EXPECT_EQ(edit_distance("", ""), 0u);
  EXPECT_EQ(edit_distance("abc", ""), 3u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(edit_distance("training", "trainnig"), 1u);
  EXPECT_EQ(edit_distance("size", "sise"), 1u);
}

// The textbook optimal-string-alignment table, in full: what edit_distance_within must
// agree with wherever the distance is within its limit.
std::size_t reference_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

TEST(ConfigSuggest, BoundedEditDistanceIsExactUpToItsLimit) {
  EXPECT_EQ(edit_distance_within("kitten", "sitting", 3), 3u);
  EXPECT_EQ(edit_distance_within("kitten", "sitting", 2), 3u);  // limit + 1: above the limit
  EXPECT_EQ(edit_distance_within("training", "trainnig", 0), 1u);
  EXPECT_EQ(edit_distance_within("abc", "abc", 0), 0u);
  // Random words over a 3-letter alphabet (many repeats and swaps), every limit up to
  // beyond the distance.
  std::mt19937 random(18);
  auto word = [&] {
    std::string w(random() % 9, 'a');
    for (char& c : w) c = static_cast<char>('a' + random() % 3);
    return w;
  };
  for (int trial = 0; trial < 2000; ++trial) {
    const std::string a = word(), b = word();
    const std::size_t expected = reference_distance(a, b);
    ASSERT_EQ(edit_distance(a, b), expected) << a << " / " << b;
    for (std::size_t limit = 0; limit <= 9; ++limit)
      ASSERT_EQ(edit_distance_within(a, b, limit), std::min(expected, limit + 1)) << a << " / " << b << " limit " << limit;
  }
}

TEST(ConfigSuggest, SuggestsOnlyCloseCandidates) {
  EXPECT_EQ(closest_match("mok", {"synthetic", "mock", "indexed"}), "mock");
  EXPECT_EQ(closest_match("llama3.1-7b", {"llama2-7b", "llama3.1-8b"}), "llama3.1-8b");
  EXPECT_EQ(closest_match("completely-different", {"mock"}), std::nullopt);
}

TEST(ConfigSuggest, ClosestMatchIsTheNearestCandidateWithinTheThreshold) {
  // closest_match skips candidates by length and by bag distance before computing a
  // bounded distance; none of that may change its answer: the first candidate at the
  // smallest distance, if within max(2, |word| / 4).
  std::mt19937 random(1812);
  auto word = [&](std::size_t max_length) {
    std::string w(random() % (max_length + 1), 'a');
    for (char& c : w) c = static_cast<char>('a' + random() % 4);
    return w;
  };
  for (int trial = 0; trial < 500; ++trial) {
    const std::string target = word(24);
    std::vector<std::string> candidates;
    for (int i = 0; i < 12; ++i) candidates.push_back(word(24));
    std::optional<std::string> expected;
    std::size_t best = std::max<std::size_t>(2, target.size() / 4) + 1;
    for (const auto& candidate : candidates) {
      const std::size_t distance = reference_distance(target, candidate);
      if (distance < best) {
        best = distance;
        expected = candidate;
      }
    }
    ASSERT_EQ(closest_match(target, candidates), expected) << target;
  }
}

TEST(ConfigSuggest, AHugeUnknownWordIsNotComparedCellByCell) {
  // Compared in full, each candidate would need a 4M x 10 table of distances (320 MB) and
  // 40M steps; a candidate that short can never be within the threshold of 1M.
  const std::string huge(4'000'000, 'k');
  EXPECT_EQ(closest_match(huge, {"mock", "synthetic", "indexed"}), std::nullopt);
  EXPECT_EQ(suggest_config_key(huge), std::nullopt);
  EXPECT_EQ(suggest_config_key("training." + huge), std::nullopt);
}

TEST(ConfigSuggest, SuggestsConfigKeysByFullNameThenByLastComponent) {
  EXPECT_EQ(suggest_config_key("training.local_batch_sise"), "training.local_batch_size");
  EXPECT_EQ(suggest_config_key("trainig.steps"), "training.steps");
  EXPECT_EQ(suggest_config_key("model.rope_scaling.factr"), "model.rope_scaling.factor");
  EXPECT_EQ(suggest_config_key("training.lr"), "optimizer.lr");
  EXPECT_EQ(suggest_config_key("weight_decay"), "optimizer.weight_decay");
  EXPECT_EQ(suggest_config_key("nothing.like.any.key.at.xyzzyq"), std::nullopt);
  EXPECT_EQ(did_you_mean(std::nullopt), "");
  EXPECT_EQ(did_you_mean("a.b"), " — did you mean 'a.b'?");
}

}  // namespace
}  // namespace forge
