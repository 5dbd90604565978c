// GPT-style packing of an indexed dataset, with megatron-core's GPTDataset semantics.
//
// The sequences of the .bin/.idx (each a "document" to GPTDataset, which splits by
// sequence) are divided into train/validation/test ranges by the --split weights: the
// weights are normalized, accumulated into bookends [b_i, b_{i+1}), and split i gets the
// sequences [round(b_i * N), round(b_{i+1} * N)) with Python's round-half-to-even.
// Within a split, every epoch shuffles the split's sequences by seed, concatenates them
// into one token stream of T tokens, and cuts it into (T - 1) / seq_len samples where
// sample i is tokens [i * seq_len, i * seq_len + seq_len + 1): consecutive samples share
// one token, so every token of the stream is a target exactly once. The order in which
// samples are visited is shuffled by the DataLoader (shuffle_samples() is true). The
// shuffles use forge's Rng, not numpy's, so the sample contents differ from Megatron's
// for the same seed while the packing rules are the same.
//
// PackedOrder::InFileOrder packs the same way without any shuffle: the range's sequences
// in file order, the same stream every epoch, and samples visited in order
// (shuffle_samples() is false), so the first N samples are the stream's first N windows.
// It is how a separate validation file is read (NOTE [Separate validation data] in
// make_dataset.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/indexed_dataset.h"

namespace forge {

struct SequenceRange {
  int64_t begin = 0, end = 0;
};

// The sequences of `split` among num_sequences, as megatron-core assigns them for the
// split string (e.g. "969,30,1"). Fails naming data.split when the string is malformed or
// gives the split nothing.
SequenceRange split_sequence_range(const std::string& split, Split which, int64_t num_sequences);

enum class PackedOrder {
  Shuffled,     // sequences reshuffled by seed every epoch, samples visited in a seeded order
  InFileOrder,  // sequences in file order, samples in order, the same in every epoch
};

class PackedDataset : public TokenDataset {
 public:
  // split_seed is unused in file order.
  PackedDataset(std::shared_ptr<const IndexedDataset> data, SequenceRange range, int64_t seq_len,
                int64_t vocab_size, uint64_t split_seed, PackedOrder order = PackedOrder::Shuffled);
  int64_t num_samples() const override { return num_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override;
  bool shuffle_samples() const override { return order_ == PackedOrder::Shuffled; }

 private:
  // One epoch's sequence order and where each sequence starts in the token stream.
  struct EpochLayout {
    int64_t epoch;
    std::vector<int64_t> order;
    std::vector<int64_t> starts;
  };
  std::shared_ptr<const EpochLayout> layout(int64_t epoch) const;

  std::shared_ptr<const IndexedDataset> data_;
  SequenceRange range_;
  int64_t seq_len_, vocab_size_;
  uint64_t split_seed_;
  PackedOrder order_;
  int64_t num_samples_ = 0;
  mutable std::mutex mutex_;
  mutable std::shared_ptr<const EpochLayout> cached_;
};

}  // namespace forge
