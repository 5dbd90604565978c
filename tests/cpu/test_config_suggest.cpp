// Edit distance and did-you-mean suggestions.
#include <gtest/gtest.h>

#include <string>

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

TEST(ConfigSuggest, SuggestsOnlyCloseCandidates) {
  EXPECT_EQ(closest_match("mok", {"synthetic", "mock", "indexed"}), "mock");
  EXPECT_EQ(closest_match("llama3.1-7b", {"llama2-7b", "llama3.1-8b"}), "llama3.1-8b");
  EXPECT_EQ(closest_match("completely-different", {"mock"}), std::nullopt);
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
