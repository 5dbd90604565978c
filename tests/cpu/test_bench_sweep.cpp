// expand_sweep: the cartesian product in its documented order, the args string of each
// point, and the lists it must refuse (keys that take one value, bad or repeated items).
#include <gtest/gtest.h>

#include "cli/bench_sweep.h"
#include "config_test_support.h"

namespace forge {
namespace {

using config_test::expect_error;

std::vector<std::string> args_of(const std::vector<SweepPoint>& points) {
  std::vector<std::string> args;
  for (const auto& point : points) args.push_back(point.args);
  return args;
}

TEST(BenchSweep, CartesianProductWithTheLastKeyFastest) {
  const auto points = expand_sweep(
      {{"training.local_batch_size", "1,2,4"}, {"training.seq_len", "4096, 8192"}, {"model.name", "llama3.1-8b"}});
  ASSERT_EQ(points.size(), 6u);
  EXPECT_EQ(args_of(points), (std::vector<std::string>{
                                 "--training.local_batch_size 1 --training.seq_len 4096 --model.name llama3.1-8b",
                                 "--training.local_batch_size 1 --training.seq_len 8192 --model.name llama3.1-8b",
                                 "--training.local_batch_size 2 --training.seq_len 4096 --model.name llama3.1-8b",
                                 "--training.local_batch_size 2 --training.seq_len 8192 --model.name llama3.1-8b",
                                 "--training.local_batch_size 4 --training.seq_len 4096 --model.name llama3.1-8b",
                                 "--training.local_batch_size 4 --training.seq_len 8192 --model.name llama3.1-8b"}));
  const ConfigOverrides expected = {
      {"training.local_batch_size", "2"}, {"training.seq_len", "8192"}, {"model.name", "llama3.1-8b"}};
  EXPECT_EQ(points[3].overrides, expected);
}

TEST(BenchSweep, ListsOnNumbersBoolsEnumsAndModelNames) {
  const auto points = expand_sweep({{"model.name", "llama3.1-8b,mistral-7b-v0.1"},
                                    {"optimizer.lr", "1e-4,3e-4"},
                                    {"logging.profile_ops", "true,false"},
                                    {"precision.compute_dtype", "bf16,fp32"},
                                    {"training.device", "cuda"}});
  ASSERT_EQ(points.size(), 16u);
  EXPECT_EQ(points.front().args,
            "--model.name llama3.1-8b --optimizer.lr 1e-4 --logging.profile_ops true --precision.compute_dtype bf16 "
            "--training.device cuda");
  EXPECT_EQ(points.back().args,
            "--model.name mistral-7b-v0.1 --optimizer.lr 3e-4 --logging.profile_ops false "
            "--precision.compute_dtype fp32 --training.device cuda");
}

TEST(BenchSweep, NoOverridesIsOnePointAndFreeTextIsKeptWhole) {
  const auto none = expand_sweep({});
  ASSERT_EQ(none.size(), 1u);
  EXPECT_TRUE(none[0].overrides.empty());
  EXPECT_EQ(none[0].args, "");
  const auto points = expand_sweep({{"data.split", "969,30,1"},
                                    {"data.blend", "0.3 /d/a 0.7 /d/it's"},
                                    {"logging.run_dir", "runs/x"}});
  ASSERT_EQ(points.size(), 1u);
  EXPECT_EQ(points[0].overrides[0].second, "969,30,1");
  EXPECT_EQ(points[0].args, "--data.split 969,30,1 --data.blend '0.3 /d/a 0.7 /d/it'\\''s' --logging.run_dir runs/x");
}

TEST(BenchSweep, LoraTargetModulesAreOneValue) {
  const auto points = expand_sweep({{"lora.target_modules", "q_proj,k_proj,v_proj,o_proj"}});
  ASSERT_EQ(points.size(), 1u);
  EXPECT_EQ(points[0].overrides[0].second, "q_proj,k_proj,v_proj,o_proj");
}

// NOTE [FP8 filter]: the filter's list is one value, beside a swept recipe.
TEST(BenchSweep, Fp8FilterIsOneValue) {
  const auto points =
      expand_sweep({{"precision.fp8", "tensorwise,delayed"}, {"precision.fp8_filter_fqns", "layers.0.,layers.31."}});
  ASSERT_EQ(points.size(), 2u);
  for (const auto& point : points) EXPECT_EQ(point.overrides[1].second, "layers.0.,layers.31.");
}

TEST(BenchSweep, RefusesListsOnKeysThatTakeOneValue) {
  expect_error([] { expand_sweep({{"data.path", "/d/a,/d/b"}}); },
               {"--data.path takes one value", "'/d/a,/d/b'", "model.name"});
  expect_error([] { expand_sweep({{"logging.run_dir", "a,b"}}); }, {"--logging.run_dir takes one value"});
}

TEST(BenchSweep, RefusesBadItemsAndKeys) {
  expect_error([] { expand_sweep({{"training.local_batch_size", "1,x"}}); },
               {"training.local_batch_size expects an integer >= 1, got 'x'"});
  expect_error([] { expand_sweep({{"training.local_batch_size", "1,0"}}); }, {"got '0'"});
  expect_error([] { expand_sweep({{"training.device", "cpu,gpu"}}); }, {"training.device expects one of cpu, cuda"});
  expect_error([] { expand_sweep({{"training.seq_len", "4096,,8192"}}); },
               {"--training.seq_len lists an empty value in '4096,,8192'"});
  expect_error([] { expand_sweep({{"training.seq_len", "4096,"}}); }, {"empty value"});
  expect_error([] { expand_sweep({{"training.seq_len", "4096,8192,4096"}}); }, {"lists '4096' twice"});
  expect_error([] { expand_sweep({{"training.seq_len", "4096"}, {"training.seq_len", "8192"}}); },
               {"--training.seq_len is given twice", "'4096,8192'"});
  expect_error([] { expand_sweep({{"training.seq_lne", "1,2"}}); },
               {"unknown key 'training.seq_lne'", "did you mean 'training.seq_len'?"});
  expect_error([] { expand_sweep({{"model.rope_scaling", "1,2"}}); }, {"is a group of keys"});
}

}  // namespace
}  // namespace forge
