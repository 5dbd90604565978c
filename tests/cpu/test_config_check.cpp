// ValueRange and KeyDescriber, the pieces every config rule is written with: bounds and
// their wording, NaN outside every range, and keys named with or without origins.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/config_check.h"
#include "expect_error.h"

namespace forge {
namespace {

TEST(ValueRange, ContainsRespectsExclusiveBoundsAndRejectsNan) {
  EXPECT_TRUE(at_least(1).contains(1));
  EXPECT_FALSE(at_least(1).contains(0.5));
  EXPECT_FALSE(above(0).contains(0));
  EXPECT_TRUE(above(0).contains(1e-12));
  const ValueRange unit = {0.0, 1.0, false, true};
  EXPECT_TRUE(unit.contains(0));
  EXPECT_FALSE(unit.contains(1));
  EXPECT_FALSE(unit.contains(std::nan("")));
  EXPECT_FALSE(ValueRange{}.contains(std::nan("")));
  EXPECT_TRUE(ValueRange{}.contains(-1e300));
}

TEST(ValueRange, DescribesItsBounds) {
  EXPECT_EQ(at_least(1).describe(), ">= 1");
  EXPECT_EQ(above(0).describe(), "> 0");
  EXPECT_EQ((ValueRange{0.0, 1.0, false, true}).describe(), "in [0, 1)");
  EXPECT_EQ((ValueRange{1, 3}).describe(), "in [1, 3]");
  EXPECT_EQ((ValueRange{std::nullopt, 0.5, false, true}).describe(), "< 0.5");
  EXPECT_EQ(ValueRange{}.describe(), "");
}

TEST(KeyDescriber, NamesKeyAndValueWithOriginWhenKnown) {
  const KeyDescriber plain;
  EXPECT_EQ(plain.describe("model.num_heads", 30), "model.num_heads (30)");
  EXPECT_EQ(plain.origin_suffix("model.num_heads"), "");
  const KeyDescriber with_origins([](std::string_view key) {
    return key == "model.num_heads" ? std::string("exp.yaml:5") : std::string("command line");
  });
  EXPECT_EQ(with_origins.describe("model.num_heads", 30), "model.num_heads = 30 (exp.yaml:5)");
  EXPECT_EQ(with_origins.describe("optimizer.lr", 0.5), "optimizer.lr = 0.5 (command line)");
  EXPECT_EQ(with_origins.origin_suffix("optimizer.lr"), " (command line)");
}

TEST(KeyDescriber, SingleValueChecksNameKeyValueAndOrigin) {
  const KeyDescriber plain;
  const KeyDescriber from_file([](std::string_view) { return std::string("exp.yaml:2"); });
  expect_error([&] { check_range(plain, "optimizer.eps", 0.0, above(0)); }, {"optimizer.eps must be > 0, got 0"});
  expect_error([&] { check_range(from_file, "model.num_layers", int64_t{0}, at_least(1)); },
               {"model.num_layers must be >= 1, got 0 (exp.yaml:2)"});
  check_range(plain, "model.num_layers", int64_t{1}, at_least(1));
  expect_error([&] { check_choice(plain, "optimizer.name", "sgd", {"adamw"}); },
               {"optimizer.name must be adamw, got 'sgd'"});
  expect_error([&] { check_choice(from_file, "lr_scheduler.decay_style", "cosin", {"cosine", "linear"}); },
               {"lr_scheduler.decay_style must be one of cosine, linear, got 'cosin' (exp.yaml:2)"});
  check_choice(plain, "lr_scheduler.decay_style", "linear", {"cosine", "linear"});
}

}  // namespace
}  // namespace forge
