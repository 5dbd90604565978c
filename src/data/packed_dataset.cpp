#include "data/packed_dataset.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace forge {

namespace {

std::vector<double> parse_split_weights(const std::string& split) {
  std::vector<double> weights;
  size_t begin = 0;
  while (true) {
    size_t end = split.find(',', begin);
    if (end == std::string::npos) end = split.size();
    double weight = 0.0;
    auto [ptr, ec] = std::from_chars(split.data() + begin, split.data() + end, weight);
    if (ec != std::errc() || ptr != split.data() + end || !(weight >= 0.0) || !std::isfinite(weight))
      FORGE_FAIL("data.split '{}': expected up to three non-negative comma-separated weights such as \"969,30,1\"",
                 split);
    weights.push_back(weight);
    if (end == split.size()) break;
    begin = end + 1;
  }
  if (weights.size() > 3)
    FORGE_FAIL("data.split '{}' has {} weights: expected at most three (train, validation, test)", split,
               weights.size());
  weights.resize(3, 0.0);
  double total = weights[0] + weights[1] + weights[2];
  if (!(total > 0.0)) FORGE_FAIL("data.split '{}': expected at least one positive weight", split);
  for (double& w : weights) w /= total;
  return weights;
}

}  // namespace

SequenceRange split_sequence_range(const std::string& split, Split which, int64_t num_sequences) {
  std::vector<double> weights = parse_split_weights(split);
  int index = static_cast<int>(which);
  double low = 0.0;
  for (int i = 0; i < index; ++i) low += weights[i];
  double high = low + weights[index];
  if (!(high > low)) FORGE_FAIL("data.split '{}' gives the {} split no weight", split, split_name(which));
  // std::nearbyint rounds half to even in the default rounding mode, as Python's round().
  SequenceRange range{static_cast<int64_t>(std::nearbyint(low * static_cast<double>(num_sequences))),
                      static_cast<int64_t>(std::nearbyint(high * static_cast<double>(num_sequences)))};
  if (range.end <= range.begin)
    FORGE_FAIL("data.split '{}' gives the {} split none of the {} sequences", split, split_name(which),
               num_sequences);
  return range;
}

PackedDataset::PackedDataset(std::shared_ptr<const IndexedDataset> data, SequenceRange range, int64_t seq_len,
                             int64_t vocab_size, uint64_t split_seed, PackedOrder order)
    : data_(std::move(data)), range_(range), seq_len_(seq_len), vocab_size_(vocab_size), split_seed_(split_seed),
      order_(order) {
  int64_t tokens = 0;
  for (int64_t s = range_.begin; s < range_.end; ++s) tokens += data_->sequence_length(s);
  num_samples_ = tokens > 0 ? (tokens - 1) / seq_len_ : 0;
  if (num_samples_ == 0)
    FORGE_FAIL("{}: sequences [{}, {}) hold {} tokens: expected at least seq_len + 1 = {} for one sample",
               data_->idx_path(), range_.begin, range_.end, tokens, seq_len_ + 1);
}

std::shared_ptr<const PackedDataset::EpochLayout> PackedDataset::layout(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (cached_ && (cached_->epoch == epoch || order_ == PackedOrder::InFileOrder)) return cached_;
  auto next = std::make_shared<EpochLayout>();
  next->epoch = epoch;
  next->order.resize(static_cast<size_t>(range_.end - range_.begin));
  std::iota(next->order.begin(), next->order.end(), range_.begin);
  if (order_ == PackedOrder::Shuffled) {
    Rng rng(derive_seed(split_seed_, static_cast<uint64_t>(epoch)));
    for (size_t i = next->order.size(); i > 1; --i) std::swap(next->order[i - 1], next->order[rng.below(i)]);
  }
  next->starts.resize(next->order.size() + 1);
  next->starts[0] = 0;
  for (size_t i = 0; i < next->order.size(); ++i)
    next->starts[i + 1] = next->starts[i] + data_->sequence_length(next->order[i]);
  cached_ = next;
  return cached_;
}

void PackedDataset::sample(int64_t epoch, int64_t index, int32_t* out) const {
  FORGE_CHECK(index >= 0 && index < num_samples_ && epoch >= 0, "sample {} of {} in epoch {}", index, num_samples_,
              epoch);
  std::shared_ptr<const EpochLayout> epoch_layout = layout(epoch);
  const std::vector<int64_t>& starts = epoch_layout->starts;
  int64_t position = index * seq_len_;
  int64_t remaining = seq_len_ + 1;
  size_t slot = static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), position) - starts.begin()) - 1;
  while (remaining > 0) {
    int64_t sequence = epoch_layout->order[slot];
    int64_t offset = position - starts[slot];
    int64_t count = std::min(remaining, data_->sequence_length(sequence) - offset);
    data_->read_tokens(sequence, offset, count, vocab_size_, out);
    out += count;
    position += count;
    remaining -= count;
    ++slot;
  }
}

}  // namespace forge
