// Blends (data.blend): parsing and its errors, Megatron's greedy interleave (every prefix
// of the sample stream within one sample of the weights), components wrapping into
// further epochs of themselves, determinism per seed, and make_dataset's wiring with
// real indexed datasets, including errors that name the missing files.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <functional>
#include <map>
#include <set>

#include "expect_error.h"
#include "core/error.h"
#include "data/blended_dataset.h"
#include "data/dataset.h"
#include "data/indexed_dataset.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

// A component whose sample says who it is: [id, epoch, index, ...].
class LabeledDataset : public TokenDataset {
 public:
  LabeledDataset(int32_t id, int64_t samples) : id_(id), samples_(samples) {}
  int64_t num_samples() const override { return samples_; }
  int64_t seq_len() const override { return 3; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override {
    out[0] = id_;
    out[1] = static_cast<int32_t>(epoch);
    out[2] = static_cast<int32_t>(index);
    out[3] = 0;
  }
  bool shuffle_samples() const override { return true; }

 private:
  int32_t id_;
  int64_t samples_;
};

BlendedDataset labeled_blend(const std::vector<int64_t>& sizes, const std::vector<double>& weights, uint64_t seed) {
  std::vector<std::unique_ptr<TokenDataset>> components;
  for (size_t i = 0; i < sizes.size(); ++i)
    components.push_back(std::make_unique<LabeledDataset>(static_cast<int32_t>(i), sizes[i]));
  return BlendedDataset(std::move(components), weights, seed);
}

std::vector<std::array<int32_t, 4>> draw(const TokenDataset& data, int64_t count) {
  std::vector<std::array<int32_t, 4>> samples;
  for (int64_t g = 0; g < count; ++g) {
    std::array<int32_t, 4> sample{};
    data.sample(g / data.num_samples(), g % data.num_samples(), sample.data());
    samples.push_back(sample);
  }
  return samples;
}

TEST(DataBlendParse, WeightsArePairedWithPrefixesAndNormalized) {
  std::vector<BlendComponent> blend = parse_blend("  30 /data/a_text_document\n 70 /data/b ");
  ASSERT_EQ(blend.size(), 2u);
  EXPECT_DOUBLE_EQ(blend[0].weight, 0.3);
  EXPECT_EQ(blend[0].prefix, "/data/a_text_document");
  EXPECT_DOUBLE_EQ(blend[1].weight, 0.7);
  EXPECT_EQ(blend[1].prefix, "/data/b");
  EXPECT_DOUBLE_EQ(parse_blend("1e-3 x")[0].weight, 1.0);
}

TEST(DataBlendParse, BadBlendsNameTheProblem) {
  expect_error([] { parse_blend("0.3 a 0.7"); }, {"data.blend", "3 words", "pairs"});
  expect_error([] { parse_blend("   "); }, {"data.blend is empty"});
  expect_error([] { parse_blend("0.5 a 0 b"); }, {"weight 2", "'0'", "positive number", "'b'"});
  expect_error([] { parse_blend("-1 a 2 b"); }, {"weight 1", "'-1'"});
  expect_error([] { parse_blend("a 0.5 b 0.5"); }, {"weight 1", "'a'"});
  expect_error([] { parse_blend("nan a"); }, {"'nan'"});
}

// Megatron's build_blending_indices: at every prefix of the stream, each component's
// count is within one sample of weight x samples drawn.
TEST(DataBlendInterleave, EveryPrefixFollowsTheWeights) {
  const std::vector<double> weights = {0.2, 0.5, 0.3};
  BlendedDataset blend = labeled_blend({50, 400, 100}, weights, 7);
  EXPECT_EQ(blend.num_samples(), 550);
  EXPECT_FALSE(blend.shuffle_samples());
  std::vector<int64_t> counts(3, 0);
  const auto samples = draw(blend, 7 * blend.num_samples());
  for (size_t g = 0; g < samples.size(); ++g) {
    ++counts[static_cast<size_t>(samples[g][0])];
    const int64_t drawn = static_cast<int64_t>(g) + 1;
    for (size_t i = 0; i < 3; ++i)
      ASSERT_LE(std::abs(static_cast<double>(counts[i]) - weights[i] * static_cast<double>(drawn)), 1.0)
          << "component " << i << " after " << drawn << " samples";
  }
  EXPECT_EQ(blend.component_of(0, 0), 1) << "the first sample goes to the largest weight, as in Megatron";
}

// A component with more weight than data wraps into its next epoch; each of its epochs
// visits every one of its samples once, in a fresh order.
TEST(DataBlendInterleave, ComponentsWrapIntoFurtherEpochsAsPermutations) {
  BlendedDataset blend = labeled_blend({10, 1000}, {0.5, 0.5}, 3);
  std::map<int32_t, std::vector<int32_t>> indices_by_epoch;
  for (const auto& sample : draw(blend, 2 * blend.num_samples()))
    if (sample[0] == 0) indices_by_epoch[sample[1]].push_back(sample[2]);
  ASSERT_GE(indices_by_epoch.size(), 100u);
  for (int32_t epoch = 0; epoch < 100; ++epoch) {
    const auto& indices = indices_by_epoch[epoch];
    ASSERT_EQ(indices.size(), 10u) << "epoch " << epoch;
    EXPECT_EQ(std::set<int32_t>(indices.begin(), indices.end()).size(), 10u) << "epoch " << epoch;
  }
  EXPECT_NE(indices_by_epoch[0], indices_by_epoch[1]) << "each epoch is reshuffled";
}

TEST(DataBlendInterleave, DeterministicPerSeed) {
  const auto a = draw(labeled_blend({30, 70}, {0.4, 0.6}, 11), 500);
  const auto b = draw(labeled_blend({30, 70}, {0.4, 0.6}, 11), 500);
  const auto c = draw(labeled_blend({30, 70}, {0.4, 0.6}, 12), 500);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  for (size_t g = 0; g < a.size(); ++g) ASSERT_EQ(a[g][0], c[g][0]) << "the interleave does not depend on the seed";
}

// Random access (as after a checkpoint resume) gives the same samples as sequential reads.
TEST(DataBlendInterleave, RandomAccessMatchesSequentialAccess) {
  BlendedDataset blend = labeled_blend({37, 501, 64}, {0.1, 0.6, 0.3}, 5);
  const auto sequential = draw(blend, 2 * blend.num_samples());
  for (int64_t g : {1201L, 3L, 999L, 0L, 602L, 600L, 257L, 1203L}) {
    std::array<int32_t, 4> sample{};
    blend.sample(g / blend.num_samples(), g % blend.num_samples(), sample.data());
    EXPECT_EQ(sample, sequential[static_cast<size_t>(g)]) << "sample " << g;
  }
}

// Datasets whose tokens say which file they came from: file f holds ids 100 f + 0..9.
void write_component(const std::string& prefix, int file, int documents) {
  IndexedDatasetWriter writer(prefix, IndexedDType::U16);
  for (int d = 0; d < documents; ++d) {
    std::vector<int32_t> tokens(static_cast<size_t>(20 + d % 13));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = 100 * file + static_cast<int32_t>((d + i) % 10);
    writer.add_document(tokens);
  }
  writer.finalize();
}

TEST(DataBlendMakeDataset, BlendsIndexedDatasetsByWeight) {
  TempDir dir;
  write_component(dir.file("a"), 1, 300);
  write_component(dir.file("b"), 2, 40);
  DataConfig config{.source = "indexed", .blend = "0.25 " + dir.file("a") + " 0.75 " + dir.file("b"),
                    .split = "90,10,0"};
  auto train = make_dataset(config, Split::Train, 16, 300, 42);
  auto again = make_dataset(config, Split::Train, 16, 300, 42);
  std::vector<int32_t> sample(17), other(17);
  int from_a = 0;
  const int64_t drawn = 4 * train->num_samples();
  for (int64_t g = 0; g < drawn; ++g) {
    train->sample(g / train->num_samples(), g % train->num_samples(), sample.data());
    again->sample(g / train->num_samples(), g % train->num_samples(), other.data());
    ASSERT_EQ(sample, other);
    const int file = sample[0] / 100;
    for (int32_t token : sample) ASSERT_EQ(token / 100, file) << "a sample never mixes components";
    from_a += file == 1;
  }
  EXPECT_NEAR(static_cast<double>(from_a) / static_cast<double>(drawn), 0.25, 1.0 / static_cast<double>(drawn));
  auto validation = make_dataset(config, Split::Validation, 16, 300, 42);
  EXPECT_GT(validation->num_samples(), 0);
}

TEST(DataBlendMakeDataset, ErrorsNameTheKeyAndTheMissingFiles) {
  TempDir dir;
  write_component(dir.file("a"), 1, 50);
  DataConfig config{.source = "indexed", .blend = "0.5 " + dir.file("a") + " 0.5 " + dir.file("missing")};
  expect_error([&] { make_dataset(config, Split::Train, 16, 300, 1); },
               {"data.blend dataset 2 of 2", dir.file("missing")});
  config.path = dir.file("a");
  expect_error([&] { make_dataset(config, Split::Train, 16, 300, 1); }, {"data.path", "data.blend", "both"});
  config = {.source = "indexed", .blend = "0.5 " + dir.file("a") + " 0.5"};
  expect_error([&] { make_dataset(config, Split::Train, 16, 300, 1); }, {"data.blend", "pairs"});
}

}  // namespace
}  // namespace forge
