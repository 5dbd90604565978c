// parse_overrides: both syntaxes, and the malformed command lines it must reject.
#include <gtest/gtest.h>

#include "cli/config.h"
#include "config_test_support.h"

namespace forge {
namespace {

using config_test::expect_error;

TEST(ConfigOverrides, AcceptsSpaceAndEqualsSyntax) {
  const ConfigOverrides overrides = parse_overrides(
      {"--training.local_batch_size", "6", "--optimizer.lr=1e-4", "--data.path=", "--logging.run_dir", "a=b",
       "--model.rope_scaling.factor", "-8"});
  const ConfigOverrides expected = {{"training.local_batch_size", "6"},
                                    {"optimizer.lr", "1e-4"},
                                    {"data.path", ""},
                                    {"logging.run_dir", "a=b"},
                                    {"model.rope_scaling.factor", "-8"}};
  EXPECT_EQ(overrides, expected);
  EXPECT_TRUE(parse_overrides({}).empty());
}

TEST(ConfigOverrides, RejectsDanglingKey) {
  expect_error([] { parse_overrides({"--training.steps"}); }, {"--training.steps has no value"});
  expect_error([] { parse_overrides({"--training.steps", "--eval.steps", "2"}); }, {"--training.steps has no value"});
}

TEST(ConfigOverrides, RejectsArgumentsThatAreNotSectionKeys) {
  expect_error([] { parse_overrides({"steps"}); }, {"expected an override --section.key", "'steps'",
                                                    "did you mean 'training.steps'?"});
  expect_error([] { parse_overrides({"--steps=10"}); }, {"'--steps=10'", "did you mean 'training.steps'?"});
  expect_error([] { parse_overrides({"-training.steps", "3"}); }, {"'-training.steps'"});
  expect_error([] { parse_overrides({"--.steps", "3"}); }, {"'--.steps'"});
  expect_error([] { parse_overrides({"--training.", "3"}); }, {"'--training.'"});
}

}  // namespace
}  // namespace forge
