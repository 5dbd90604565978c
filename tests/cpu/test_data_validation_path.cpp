// data.validation_path (NOTE [Separate validation data] in make_dataset.cpp): validation
// and test read the whole validation file packed in file order and visited in order, the
// same for every seed and epoch; training reads all of data.path (data.split unused); and
// the errors name the key, the file and what was expected.
#include <gtest/gtest.h>

#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/dataset.h"
#include "data/indexed_dataset.h"
#include "expect_error.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

constexpr int64_t kVocab = 100000;

// Writes one document per length; token i of sequence s is s * 1000 + i, so a packed
// stream can be parsed back. Returns the file's concatenated token stream.
std::vector<int32_t> write_encoded(const std::string& prefix, const std::vector<int>& lengths) {
  IndexedDatasetWriter writer(prefix, IndexedDType::I32);
  std::vector<int32_t> stream;
  for (size_t s = 0; s < lengths.size(); ++s) {
    std::vector<int32_t> tokens(static_cast<size_t>(lengths[s]));
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(s * 1000 + i);
    writer.add_document(tokens);
    stream.insert(stream.end(), tokens.begin(), tokens.end());
  }
  writer.finalize();
  return stream;
}

std::vector<int> varied_lengths(int count) {
  std::vector<int> lengths;
  for (int s = 0; s < count; ++s) lengths.push_back(1 + (s * 7) % 13);
  return lengths;
}

DataConfig indexed_config(const std::string& path, const std::string& validation_path) {
  DataConfig config;
  config.source = "indexed";
  config.path = path;
  config.validation_path = validation_path;
  return config;
}

// Sample i must be stream[i * seq_len, i * seq_len + seq_len + 1), whatever the seed,
// epoch or split (validation and test read the same file).
TEST(DataValidationPath, SamplesAreTheFileStreamInOrder) {
  TempDir dir;
  write_encoded(dir.file("train"), varied_lengths(10));
  const std::vector<int32_t> stream = write_encoded(dir.file("valid"), varied_lengths(30));
  const int64_t seq_len = 6;
  const int64_t expected_samples = (static_cast<int64_t>(stream.size()) - 1) / seq_len;
  DataConfig config = indexed_config(dir.file("train"), dir.file("valid"));
  config.split = "1,0,0";  // unused: would give validation nothing
  for (Split split : {Split::Validation, Split::Test}) {
    for (uint64_t seed : {1u, 99u}) {
      auto dataset = make_dataset(config, split, seq_len, kVocab, seed);
      ASSERT_EQ(dataset->num_samples(), expected_samples);
      EXPECT_FALSE(dataset->shuffle_samples());
      std::vector<int32_t> sample(static_cast<size_t>(seq_len + 1));
      for (int64_t epoch : {0, 1, 5}) {
        for (int64_t i = 0; i < expected_samples; ++i) {
          dataset->sample(epoch, i, sample.data());
          std::vector<int32_t> expected(stream.begin() + i * seq_len, stream.begin() + i * seq_len + seq_len + 1);
          ASSERT_EQ(sample, expected) << split_name(split) << " seed " << seed << " epoch " << epoch << " sample "
                                      << i;
        }
      }
      // The loader visits them in order too, with any seed: the first batch is the
      // stream's first windows.
      DataLoader loader(*dataset, 3, seed);
      Batch batch = loader.next();
      const int32_t* tokens = batch.tokens.data<int32_t>();
      const int32_t* targets = batch.targets.data<int32_t>();
      for (int64_t row = 0; row < 3; ++row)
        for (int64_t t = 0; t < seq_len; ++t) {
          EXPECT_EQ(tokens[row * seq_len + t], stream[static_cast<size_t>(row * seq_len + t)]);
          EXPECT_EQ(targets[row * seq_len + t], stream[static_cast<size_t>(row * seq_len + t + 1)]);
        }
    }
  }
}

// The train split is all of data.path, every sequence whole, shuffled per epoch; a
// blend's datasets are read whole the same way.
TEST(DataValidationPath, TrainReadsAllOfThePath) {
  TempDir dir;
  const int64_t seq_len = 6;
  std::vector<int> lengths = varied_lengths(20);
  const int total = std::accumulate(lengths.begin(), lengths.end(), 0);
  lengths.push_back(seq_len - (total - 1) % seq_len);  // the stream cuts into whole samples
  const std::vector<int32_t> stream = write_encoded(dir.file("train"), lengths);
  ASSERT_EQ((stream.size() - 1) % seq_len, 0u);
  write_encoded(dir.file("valid"), varied_lengths(5));
  DataConfig config = indexed_config(dir.file("train"), dir.file("valid"));
  config.split = "0,1,0";  // unused: would give training nothing
  auto dataset = make_dataset(config, Split::Train, seq_len, kVocab, 4);
  ASSERT_EQ(dataset->num_samples(), (static_cast<int64_t>(stream.size()) - 1) / seq_len);
  EXPECT_TRUE(dataset->shuffle_samples());
  std::vector<std::vector<int32_t>> orders;
  for (int64_t epoch : {0, 1}) {
    std::vector<int32_t> packed, sample(static_cast<size_t>(seq_len + 1)), order;
    for (int64_t i = 0; i < dataset->num_samples(); ++i) {
      dataset->sample(epoch, i, sample.data());
      packed.insert(packed.end(), sample.begin() + (i > 0 ? 1 : 0), sample.end());
    }
    ASSERT_EQ(packed.size(), stream.size());
    for (int32_t token : packed)
      if (token % 1000 == 0) order.push_back(token / 1000);
    EXPECT_EQ(std::set<int32_t>(order.begin(), order.end()).size(), lengths.size()) << "every sequence, once";
    EXPECT_EQ(std::multiset<int32_t>(packed.begin(), packed.end()),
              std::multiset<int32_t>(stream.begin(), stream.end()));
    orders.push_back(order);
  }
  EXPECT_NE(orders[0], orders[1]) << "reshuffled per epoch";

  DataConfig blend = config;
  blend.path.clear();
  blend.blend = "1 " + dir.file("train");
  EXPECT_EQ(make_dataset(blend, Split::Train, seq_len, kVocab, 4)->num_samples(), dataset->num_samples());
  EXPECT_EQ(make_dataset(blend, Split::Validation, seq_len, kVocab, 4)->num_samples(),
            make_dataset(config, Split::Validation, seq_len, kVocab, 4)->num_samples());
}

TEST(DataValidationPath, Errors) {
  TempDir dir;
  write_encoded(dir.file("train"), varied_lengths(10));
  DataConfig synthetic;
  synthetic.validation_path = dir.file("train");
  expect_error([&] { make_dataset(synthetic, Split::Train, 4, kVocab, 1); },
               {"data.validation_path ('" + dir.file("train") + "')", "data.source indexed",
                "data.source is 'synthetic'"});

  const std::string missing = dir.file("missing");
  expect_error([&] { make_dataset(indexed_config(dir.file("train"), missing), Split::Validation, 4, kVocab, 1); },
               {"data.validation_path ('" + missing + "')", missing + ".idx"});

  write_encoded(dir.file("short"), {2, 2});
  expect_error([&] { make_dataset(indexed_config(dir.file("train"), dir.file("short")), Split::Test, 4, kVocab, 1); },
               {"data.validation_path ('" + dir.file("short") + "')", dir.file("short") + ".idx", "hold 4 tokens",
                "expected at least seq_len + 1 = 5"});

  // Token ids: sequence 1 holds 1000 and up, outside a vocabulary of 500.
  auto narrow = make_dataset(indexed_config(dir.file("train"), dir.file("short")), Split::Validation, 3, 500, 1);
  std::vector<int32_t> sample(4);
  expect_error([&] { narrow->sample(0, 0, sample.data()); },
               {dir.file("short") + ".bin", "outside the model's vocabulary [0, 500)"});
}

}  // namespace
}  // namespace forge
