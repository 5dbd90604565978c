// DataLoader: the global sample stream cut into batches (NOTE [Epochs and sample order]);
// with several ranks each reads only its own block of the global batch.
#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "data/dataset.h"

namespace forge {

DataLoader::DataLoader(const TokenDataset& dataset, int64_t micro_batch, uint64_t seed, int rank, int world)
    : dataset_(dataset), micro_batch_(micro_batch), seed_(seed), rank_(rank), world_(world) {
  FORGE_CHECK(micro_batch >= 1, "micro_batch {}", micro_batch);
  FORGE_CHECK(world >= 1 && rank >= 0 && rank < world, "rank {} of world {}", rank, world);
  FORGE_CHECK(dataset.num_samples() >= 1 && dataset.seq_len() >= 1, "dataset of {} samples of length {}",
              dataset.num_samples(), dataset.seq_len());
}

void DataLoader::set_position(int64_t position) {
  FORGE_CHECK(position >= 0, "position {}", position);
  position_ = position;
}

int64_t DataLoader::sample_in_epoch(int64_t epoch, int64_t index) {
  if (!dataset_.shuffle_samples()) return index;
  if (epoch != cached_epoch_) {
    order_.resize(static_cast<size_t>(dataset_.num_samples()));
    std::iota(order_.begin(), order_.end(), int64_t{0});
    Rng rng(derive_seed(seed_, static_cast<uint64_t>(epoch)));
    for (size_t i = order_.size(); i > 1; --i) std::swap(order_[i - 1], order_[rng.below(i)]);
    cached_epoch_ = epoch;
  }
  return order_[static_cast<size_t>(index)];
}

void TokenDataset::sample_examples(int64_t epoch, int64_t index, int32_t* tokens, int32_t* example,
                                   uint8_t* response) const {
  sample(epoch, index, tokens);
  std::fill_n(example, seq_len() + 1, 0);
  std::fill_n(response, seq_len() + 1, uint8_t{1});
}

// NOTE [Example batches]: targets, positions and segments of one row.
void DataLoader::fill_example_row(int64_t epoch, int64_t index, int64_t row, Batch& batch) {
  const int64_t seq_len = dataset_.seq_len();
  std::vector<int32_t> sample(static_cast<size_t>(seq_len + 1)), example(sample.size());
  std::vector<uint8_t> response(sample.size());
  dataset_.sample_examples(epoch, index, sample.data(), example.data(), response.data());
  int32_t* tokens = batch.tokens.data<int32_t>() + row * seq_len;
  int32_t* targets = batch.targets.data<int32_t>() + row * seq_len;
  int32_t* positions = batch.positions.data<int32_t>() + row * seq_len;
  int32_t* segments = batch.segments.data<int32_t>() + row * seq_len;
  for (int64_t i = 0; i < seq_len; ++i) {
    const size_t at = static_cast<size_t>(i);
    tokens[i] = sample[at];
    const bool counted = example[at] >= 0 && example[at + 1] == example[at] && response[at + 1] != 0;
    targets[i] = counted ? sample[at + 1] : kIgnoreIndex;
    positions[i] = i > 0 && example[at] == example[at - 1] ? positions[i - 1] + 1 : 0;
    segments[i] = example[at];
  }
}

Batch DataLoader::next() {
  const int64_t seq_len = dataset_.seq_len();
  const int64_t samples = dataset_.num_samples();
  Batch batch;
  batch.tokens = Tensor::empty({micro_batch_, seq_len}, DType::I32);
  batch.targets = Tensor::empty({micro_batch_, seq_len}, DType::I32);
  const bool examples = dataset_.has_examples();
  if (examples) {
    batch.positions = Tensor::empty({micro_batch_, seq_len}, DType::I32);
    batch.segments = Tensor::empty({micro_batch_, seq_len}, DType::I32);
  }
  std::vector<int32_t> sample(static_cast<size_t>(seq_len + 1));
  for (int64_t row = 0; row < micro_batch_; ++row) {
    int64_t global = position_ + rank_ * micro_batch_ + row;
    int64_t epoch = global / samples;
    if (examples) {
      fill_example_row(epoch, sample_in_epoch(epoch, global % samples), row, batch);
      continue;
    }
    dataset_.sample(epoch, sample_in_epoch(epoch, global % samples), sample.data());
    int32_t* tokens = batch.tokens.data<int32_t>() + row * seq_len;
    int32_t* targets = batch.targets.data<int32_t>() + row * seq_len;
    std::copy(sample.begin(), sample.end() - 1, tokens);
    std::copy(sample.begin() + 1, sample.end(), targets);
  }
  position_ += micro_batch_ * world_;
  return batch;
}

}  // namespace forge
