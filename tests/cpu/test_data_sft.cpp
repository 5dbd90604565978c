// Instruction (SFT) data: the token/mask pair's validation, packed and padded samples, the
// batch's targets, positions and segments (NOTE [Example batches]), over-long examples,
// epoch shuffles and resume.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "data/dataset.h"
#include "data/sft_dataset.h"
#include "expect_error.h"
#include "sft_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using testing::SftExample;
using testing::write_sft;

constexpr int64_t kVocab = 1000;
constexpr int32_t kIgnore = kIgnoreIndex;

std::vector<int32_t> row(const Tensor& t, int64_t r) {
  return {t.data<int32_t>() + r * t.dim(1), t.data<int32_t>() + (r + 1) * t.dim(1)};
}

std::unique_ptr<TokenDataset> sft(const std::string& prefix, int64_t seq_len, const std::string& packing = "packed",
                                  const std::string& overlong = "truncate", uint64_t seed = 5) {
  DataConfig config;
  config.source = "sft";
  config.path = prefix;
  config.split = "1";
  config.packing = packing;
  config.overlong = overlong;
  return make_dataset(config, Split::Train, seq_len, kVocab, seed);
}

// A = 1 2 3 4 (response 3 4), B = 5 6 7 (response 6 7).
const std::vector<SftExample> kTwo = {{{1, 2, 3, 4}, {0, 0, 1, 1}}, {{5, 6, 7}, {0, 1, 1}}};

TEST(DataSft, PackedSampleHasMaskedTargetsRestartingPositionsAndSegments) {
  TempDir dir;
  write_sft(dir.file("d"), kTwo);
  auto data = sft(dir.file("d"), 8);
  ASSERT_EQ(data->num_samples(), 1);  // 7 tokens fit in 9
  DataLoader loader(*data, 1, 3);
  Batch b = loader.next();
  ASSERT_TRUE(b.has_examples());
  EXPECT_EQ(b.positions.shape(), (Shape{1, 8}));
  const bool a_first = row(b.tokens, 0)[0] == 1;
  if (a_first) {
    EXPECT_EQ(row(b.tokens, 0), (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 0}));
    // the last token of A never predicts B's first; padding predicts nothing
    EXPECT_EQ(row(b.targets, 0), (std::vector<int32_t>{kIgnore, 3, 4, kIgnore, 6, 7, kIgnore, kIgnore}));
    EXPECT_EQ(row(b.positions, 0), (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 0}));
    EXPECT_EQ(row(b.segments, 0), (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, -1}));
  } else {
    EXPECT_EQ(row(b.tokens, 0), (std::vector<int32_t>{5, 6, 7, 1, 2, 3, 4, 0}));
    EXPECT_EQ(row(b.targets, 0), (std::vector<int32_t>{6, 7, kIgnore, kIgnore, 3, 4, kIgnore, kIgnore}));
    EXPECT_EQ(row(b.positions, 0), (std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0}));
    EXPECT_EQ(row(b.segments, 0), (std::vector<int32_t>{0, 0, 0, 1, 1, 1, 1, -1}));
  }
}

TEST(DataSft, PaddedPutsOneExamplePerSample) {
  TempDir dir;
  write_sft(dir.file("d"), kTwo);
  auto data = sft(dir.file("d"), 8, "padded");
  ASSERT_EQ(data->num_samples(), 2);
  DataLoader loader(*data, 2, 3);
  Batch b = loader.next();
  for (int64_t r = 0; r < 2; ++r) {
    if (row(b.tokens, r)[0] == 1) {
      EXPECT_EQ(row(b.tokens, r), (std::vector<int32_t>{1, 2, 3, 4, 0, 0, 0, 0}));
      EXPECT_EQ(row(b.targets, r), (std::vector<int32_t>{kIgnore, 3, 4, kIgnore, kIgnore, kIgnore, kIgnore, kIgnore}));
      EXPECT_EQ(row(b.positions, r), (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
      EXPECT_EQ(row(b.segments, r), (std::vector<int32_t>{0, 0, 0, 0, -1, -1, -1, -1}));
    } else {
      EXPECT_EQ(row(b.tokens, r), (std::vector<int32_t>{5, 6, 7, 0, 0, 0, 0, 0}));
      EXPECT_EQ(row(b.targets, r), (std::vector<int32_t>{6, 7, kIgnore, kIgnore, kIgnore, kIgnore, kIgnore, kIgnore}));
    }
  }
}

TEST(DataSft, ExampleFillingTheSampleExactlyKeepsItsLastTarget) {
  TempDir dir;
  write_sft(dir.file("d"), {{{1, 2, 3, 4, 5}, {0, 1, 1, 1, 1}}});
  auto data = sft(dir.file("d"), 4);  // seq_len + 1 = 5 tokens: fits whole
  DataLoader loader(*data, 1, 3);
  Batch b = loader.next();
  EXPECT_EQ(row(b.tokens, 0), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(row(b.targets, 0), (std::vector<int32_t>{2, 3, 4, 5}));
  EXPECT_EQ(row(b.positions, 0), (std::vector<int32_t>{0, 1, 2, 3}));
}

TEST(DataSft, PackingIsGreedyAndNeverSplitsAnExample) {
  TempDir dir;
  std::vector<SftExample> examples;
  for (int e = 0; e < 20; ++e) {
    SftExample x;
    for (int i = 0; i < 2 + e % 7; ++i) {
      x.tokens.push_back(e * 10 + i + 1);
      x.mask.push_back(i > 0 ? 1 : 0);
    }
    examples.push_back(x);
  }
  write_sft(dir.file("d"), examples);
  const int64_t seq_len = 15;
  auto packed = sft(dir.file("d"), seq_len);
  DataLoader loader(*packed, packed->num_samples(), 3);
  Batch b = loader.next();
  std::multiset<int32_t> firsts;
  std::vector<int32_t> tokens(seq_len + 1), example(seq_len + 1);
  std::vector<uint8_t> response(seq_len + 1);
  int64_t used_total = 0;
  for (int64_t s = 0; s < packed->num_samples(); ++s) {
    packed->sample_examples(0, s, tokens.data(), example.data(), response.data());
    int64_t used = std::count_if(example.begin(), example.end(), [](int32_t e) { return e >= 0; });
    used_total += used;
    for (int64_t i = 0; i < used; ++i) {
      const int32_t id = tokens[i] / 10;  // the example's number in the file
      if (i == 0 || example[i] != example[i - 1]) {
        firsts.insert(id);
        EXPECT_EQ(tokens[i] % 10, 1) << "an example starts at its first token";
      } else {
        EXPECT_EQ(tokens[i], tokens[i - 1] + 1) << "no example is split";
      }
    }
  }
  EXPECT_EQ(firsts.size(), 20u);
  EXPECT_EQ(std::set<int32_t>(firsts.begin(), firsts.end()).size(), 20u);
  int64_t all = 0;
  for (const SftExample& x : examples) all += static_cast<int64_t>(x.tokens.size());
  EXPECT_EQ(used_total, all);
  EXPECT_LT(packed->num_samples(), 20);
}

TEST(DataSft, OverlongExamplesAreTruncatedOrDroppedAndCounted) {
  TempDir dir;
  SftExample longer;
  for (int i = 0; i < 12; ++i) {
    longer.tokens.push_back(i + 1);
    longer.mask.push_back(i >= 2);
  }
  write_sft(dir.file("d"), {longer, kTwo[0], {{}, {}}});
  auto truncated = sft(dir.file("d"), 8);
  auto* t = dynamic_cast<SftDataset*>(truncated.get());
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->truncated_examples(), 1);
  EXPECT_EQ(t->dropped_examples(), 1);  // the empty one
  EXPECT_EQ(t->num_samples(), 2);       // 9 tokens of the long one fill a sample
  auto dropped = sft(dir.file("d"), 8, "packed", "drop");
  auto* d = dynamic_cast<SftDataset*>(dropped.get());
  EXPECT_EQ(d->truncated_examples(), 0);
  EXPECT_EQ(d->dropped_examples(), 2);
  EXPECT_EQ(d->num_samples(), 1);
  std::vector<int32_t> tokens(9), example(9);
  std::vector<uint8_t> response(9);
  t->sample_examples(0, 0, tokens.data(), example.data(), response.data());
  if (example[8] != 0) t->sample_examples(0, 1, tokens.data(), example.data(), response.data());
  EXPECT_EQ(tokens, (std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(example, (std::vector<int32_t>(9, 0)));
}

TEST(DataSft, EpochsReshuffleDeterministicallyAndResumeReadsTheSameBatches) {
  TempDir dir;
  std::vector<SftExample> examples;
  for (int e = 0; e < 12; ++e) examples.push_back({{e + 1, e + 2, e + 3}, {0, 1, 1}});
  write_sft(dir.file("d"), examples);
  auto data = sft(dir.file("d"), 4, "padded");  // 12 samples, one example each
  ASSERT_EQ(data->num_samples(), 12);
  DataLoader a(*data, 3, 9), b(*data, 3, 9);
  std::vector<std::vector<int32_t>> epoch0, epoch1;
  for (int i = 0; i < 4; ++i) {
    Batch x = a.next(), y = b.next();
    EXPECT_EQ(row(x.tokens, 0), row(y.tokens, 0));
    for (int64_t r = 0; r < 3; ++r) epoch0.push_back(row(x.tokens, r));
  }
  const int64_t saved = a.position();
  Batch after = a.next();
  DataLoader resumed(*data, 3, 9);
  resumed.set_position(saved);
  Batch again = resumed.next();
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(row(after.tokens, r), row(again.tokens, r));
    EXPECT_EQ(row(after.targets, r), row(again.targets, r));
    EXPECT_EQ(row(after.positions, r), row(again.positions, r));
  }
  for (int64_t r = 0; r < 3; ++r) epoch1.push_back(row(after.tokens, r));
  for (int i = 0; i < 3; ++i) {
    Batch x = a.next();
    for (int64_t r = 0; r < 3; ++r) epoch1.push_back(row(x.tokens, r));
  }
  EXPECT_NE(epoch0, epoch1);  // a new order
  std::sort(epoch0.begin(), epoch0.end());
  std::sort(epoch1.begin(), epoch1.end());
  EXPECT_EQ(epoch0, epoch1);  // the same samples
  // The same seed packs identically.
  auto same = sft(dir.file("d"), 4, "padded", "truncate", 5);
  std::vector<int32_t> t1(5), t2(5), e(5);
  std::vector<uint8_t> m(5);
  for (int64_t s = 0; s < 12; ++s) {
    data->sample_examples(0, s, t1.data(), e.data(), m.data());
    same->sample_examples(0, s, t2.data(), e.data(), m.data());
    EXPECT_EQ(t1, t2);
  }
}

TEST(DataSft, BadPairsNameTheFileAndWhere) {
  TempDir dir;
  // mask dtype other than uint8
  {
    IndexedDatasetWriter tokens(dir.file("dtype"), IndexedDType::I32), mask(dir.file("dtype.mask"), IndexedDType::I32);
    tokens.add_document(std::vector<int32_t>{1, 2});
    mask.add_document(std::vector<int32_t>{0, 1});
    tokens.finalize();
    mask.finalize();
  }
  expect_error([&] { sft(dir.file("dtype"), 8); }, {"dtype.mask.idx", "int32", "expected uint8"});
  // a mask value that is not 0/1: the byte offset in .mask.bin
  write_sft(dir.file("value"), {{{1, 2, 3}, {0, 1, 1}}, {{4, 5, 6}, {0, 2, 1}}});
  expect_error([&] { sft(dir.file("value"), 8); }, {"value.mask.bin", "byte offset 4", "sequence 1", "holds 2"});
  // different lengths
  write_sft(dir.file("length"), {{{1, 2, 3}, {0, 1}}});
  expect_error([&] { sft(dir.file("length"), 8); }, {"length.mask.idx", "sequence 0 has 2 mask values", "3 tokens"});
  // different sequence counts
  write_sft(dir.file("count"), {{{1, 2, 3}, {0, 1, 1}}});
  {
    IndexedDatasetWriter mask(dir.file("count.mask"), IndexedDType::U8);
    mask.add_document(std::vector<int32_t>{0, 1, 1});
    mask.add_document(std::vector<int32_t>{0, 1});
    mask.finalize();
  }
  expect_error([&] { sft(dir.file("count"), 8); }, {"count.mask.idx", "2 sequences", "expected the same"});
  // different document boundaries, same sequences
  {
    IndexedDatasetWriter tokens(dir.file("docs"), IndexedDType::I32), mask(dir.file("docs.mask"), IndexedDType::U8);
    tokens.add_sequence(std::vector<int32_t>{1, 2});
    tokens.add_sequence(std::vector<int32_t>{3, 4});
    tokens.end_document();
    tokens.add_document(std::vector<int32_t>{5, 6});
    mask.add_document(std::vector<int32_t>{0, 1});
    mask.add_sequence(std::vector<int32_t>{0, 1});
    mask.add_sequence(std::vector<int32_t>{0, 1});
    mask.end_document();
    tokens.finalize();
    mask.finalize();
  }
  expect_error([&] { sft(dir.file("docs"), 8); }, {"docs.mask.idx", "document index 1"});
  // no mask files at all
  {
    IndexedDatasetWriter tokens(dir.file("alone"), IndexedDType::I32);
    tokens.add_document(std::vector<int32_t>{1, 2});
    tokens.finalize();
  }
  expect_error([&] { sft(dir.file("alone"), 8); }, {"alone.mask"});
  // nothing to train on
  write_sft(dir.file("prompt"), {{{1, 2, 3}, {1, 0, 0}}});
  expect_error([&] { sft(dir.file("prompt"), 8); }, {"prompt.mask.bin", "no response token"});
  // token ids beyond the vocabulary, on read
  write_sft(dir.file("vocab"), {{{1, 2000, 3}, {0, 1, 1}}});
  auto data = sft(dir.file("vocab"), 8);
  DataLoader loader(*data, 1, 1);
  expect_error([&] { loader.next(); }, {"vocab.bin"});
}

TEST(DataSft, ConfigErrorsNameTheKey) {
  TempDir dir;
  write_sft(dir.file("d"), kTwo);
  expect_error([&] { sft(dir.file("d"), 8, "squeezed"); }, {"data.packing", "squeezed", "packed or padded"});
  expect_error([&] { sft(dir.file("d"), 8, "packed", "wrap"); }, {"data.overlong", "wrap", "truncate or drop"});
  DataConfig config;
  config.source = "sft";
  expect_error([&] { make_dataset(config, Split::Train, 8, kVocab, 1); }, {"data.path"});
}

TEST(DataSft, PretrainingBatchesCarryNoExamples) {
  DataConfig config;
  auto data = make_dataset(config, Split::Train, 8, 64, 1);
  DataLoader loader(*data, 2, 1);
  Batch b = loader.next();
  EXPECT_FALSE(b.has_examples());
  EXPECT_FALSE(b.segments.defined());
}

}  // namespace
}  // namespace forge
