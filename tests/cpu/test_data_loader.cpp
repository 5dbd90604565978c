// DataLoader: batch shapes, the next-token shift, rank slicing across world sizes, and
// resume from a saved position.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <vector>

#include "data/dataset.h"

namespace forge {
namespace {

// Sample i is [i*100, i*100 + 1, ...]: rows identify their sample. Optionally asks the
// loader to shuffle.
class CountingDataset : public TokenDataset {
 public:
  CountingDataset(int64_t samples, int64_t seq_len, bool shuffle) : samples_(samples), seq_len_(seq_len), shuffle_(shuffle) {}
  int64_t num_samples() const override { return samples_; }
  int64_t seq_len() const override { return seq_len_; }
  bool shuffle_samples() const override { return shuffle_; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override {
    for (int64_t i = 0; i <= seq_len_; ++i) out[i] = static_cast<int32_t>(index * 100 + i);
  }

 private:
  int64_t samples_, seq_len_;
  bool shuffle_;
};

std::vector<std::vector<int32_t>> rows(const Tensor& t) {
  std::vector<std::vector<int32_t>> out;
  for (int64_t r = 0; r < t.dim(0); ++r)
    out.emplace_back(t.data<int32_t>() + r * t.dim(1), t.data<int32_t>() + (r + 1) * t.dim(1));
  return out;
}

TEST(DataLoader, ShapesAndShift) {
  DataConfig config;
  auto dataset = make_dataset(config, Split::Train, 16, 64, 1);
  DataLoader loader(*dataset, 4, 1);
  Batch batch = loader.next();
  EXPECT_EQ(batch.tokens.shape(), (Shape{4, 16}));
  EXPECT_EQ(batch.targets.shape(), (Shape{4, 16}));
  EXPECT_EQ(batch.tokens.dtype(), DType::I32);
  std::vector<int32_t> sample(17);
  for (int64_t row = 0; row < 4; ++row) {
    dataset->sample(0, row, sample.data());
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(batch.tokens.data<int32_t>()[row * 16 + t], sample[t]);
      EXPECT_EQ(batch.targets.data<int32_t>()[row * 16 + t], sample[t + 1]);
    }
  }
  EXPECT_EQ(loader.position(), 4);
}

TEST(DataLoader, RanksPartitionTheGlobalBatch) {
  for (bool shuffle : {false, true}) {
    CountingDataset dataset(10, 3, shuffle);  // 10 samples: batches of 4 wrap epochs
    // The single reader of micro-batches of 2 reads rank 0's batch, then rank 1's, as the
    // trainer did when every rank read the whole global batch and kept its own.
    DataLoader single(dataset, 2, 9);
    DataLoader rank0(dataset, 2, 9, 0, 2), rank1(dataset, 2, 9, 1, 2);
    for (int step = 0; step < 7; ++step) {
      auto a_expected = rows(single.next().tokens), b_expected = rows(single.next().tokens);
      EXPECT_EQ(rows(rank0.next().tokens), a_expected);
      EXPECT_EQ(rows(rank1.next().tokens), b_expected);
      EXPECT_EQ(rank0.position(), single.position());
      EXPECT_EQ(rank1.position(), single.position());
    }
  }
}

TEST(DataLoader, ShuffledEpochVisitsEverySampleOnce) {
  CountingDataset dataset(12, 2, true);
  DataLoader loader(dataset, 3, 5);
  std::vector<std::set<int32_t>> epochs(2);
  std::vector<int32_t> first_epoch_order, second_epoch_order;
  for (int step = 0; step < 8; ++step)
    for (const auto& row : rows(loader.next().tokens)) {
      auto& order = step < 4 ? first_epoch_order : second_epoch_order;
      order.push_back(row[0] / 100);
      epochs[step < 4 ? 0 : 1].insert(row[0] / 100);
    }
  EXPECT_EQ(epochs[0].size(), 12u);
  EXPECT_EQ(epochs[1].size(), 12u);
  EXPECT_NE(first_epoch_order, second_epoch_order);
  std::vector<int32_t> sorted = first_epoch_order;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(first_epoch_order, sorted);
}

TEST(DataLoader, ResumesFromPosition) {
  CountingDataset dataset(7, 2, true);
  DataLoader original(dataset, 2, 3);
  for (int step = 0; step < 5; ++step) original.next();
  DataLoader resumed(dataset, 2, 3);
  resumed.set_position(original.position());
  for (int step = 0; step < 6; ++step) EXPECT_EQ(rows(original.next().tokens), rows(resumed.next().tokens));
}

}  // namespace
}  // namespace forge
