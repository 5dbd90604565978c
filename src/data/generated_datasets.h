// The two generated sources: every sample is a pure function of (split seed, index),
// so any rank can produce any sample without coordination and a resumed run sees
// exactly the samples it would have seen.
//  - MockDataset: tokens uniform over the vocabulary, as Megatron's --mock-data. Nothing
//    is learnable, so the entropy floor is ln(vocab).
//  - SyntheticDataset: walks of a MarkovSource (NOTE [Synthetic entropy floor]), forge's
//    built-in corpus with an exactly known floor.
#pragma once

#include <cstdint>
#include <memory>

#include "data/dataset.h"
#include "data/markov_source.h"

namespace forge {

class MockDataset : public TokenDataset {
 public:
  MockDataset(int64_t seq_len, int64_t vocab_size, int64_t num_samples, uint64_t split_seed);
  int64_t num_samples() const override { return num_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override;
  double entropy_floor() const override;

 private:
  int64_t seq_len_, vocab_size_, num_samples_;
  uint64_t split_seed_;
};

class SyntheticDataset : public TokenDataset {
 public:
  SyntheticDataset(std::shared_ptr<const MarkovSource> source, int64_t seq_len, int64_t num_samples,
                   uint64_t split_seed);
  int64_t num_samples() const override { return num_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override;
  double entropy_floor() const override { return source_->sample_entropy_floor(seq_len_); }
  const MarkovSource& source() const { return *source_; }

 private:
  std::shared_ptr<const MarkovSource> source_;
  int64_t seq_len_, num_samples_;
  uint64_t split_seed_;
};

}  // namespace forge
