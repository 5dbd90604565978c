// Instruction (SFT) data: examples with a loss mask, packed or padded into samples.
//
// The files (written by `forge prep --format sft`): <prefix>.bin/.idx hold the token ids,
// one sequence and one document per example; <prefix>.mask.bin/.idx is a parallel indexed
// dataset of dtype uint8 with the same sequence lengths and document indices, 1 where the
// token is a response token (its loss counts when it is a target), 0 elsewhere. Both are
// validated when opened: a mismatch names the file and the sequence or byte offset.
//
// NOTE [SFT samples]
// The split's examples (data.split over the sequences, as for indexed data) are put in a
// seeded random order once, then cut into samples of seq_len + 1 tokens:
//   packed (the default, as torchtune and NeMo pack)  greedily, in that order, as many whole
//           examples as fit in one sample; no example is split; the rest is padding;
//   padded  one example per sample, the rest padding.
// An example longer than seq_len + 1 tokens is truncated to its first seq_len + 1 tokens or
// dropped (data.overlong); empty examples are skipped; both are counted and logged once.
// The samples stay fixed for the run and the DataLoader visits them in a new seeded order
// every epoch (shuffle_samples()), so a resumed run, given the loader position, reads the
// same samples. Padding is token 0 in an example of its own (-1), never a target and seen by
// no other token (NOTE [Example batches] in dataset.h, NOTE [Packed examples] in
// ops/attention.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/dataset.h"
#include "data/indexed_dataset.h"

namespace forge {

struct SftOptions {
  bool packed = true;          // data.packing: packed | padded
  bool drop_overlong = false;  // data.overlong: truncate | drop
};

class SftDataset : public TokenDataset {
 public:
  SftDataset(const std::string& prefix, const std::string& split, Split which, int64_t seq_len, int64_t vocab_size,
             uint64_t seed, SftOptions options);
  int64_t num_samples() const override { return static_cast<int64_t>(sample_begin_.size()) - 1; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t epoch, int64_t index, int32_t* out) const override;
  bool shuffle_samples() const override { return true; }
  bool has_examples() const override { return true; }
  void sample_examples(int64_t epoch, int64_t index, int32_t* tokens, int32_t* example,
                       uint8_t* response) const override;

  // Examples cut to seq_len + 1 tokens, and those dropped (over long or empty).
  int64_t truncated_examples() const { return truncated_; }
  int64_t dropped_examples() const { return dropped_; }

 private:
  struct Piece {
    int64_t sequence;  // the example's sequence in the files
    int64_t length;    // its tokens used (all, or seq_len + 1 when truncated)
  };

  IndexedDataset tokens_, mask_;
  int64_t seq_len_, vocab_size_;
  std::vector<Piece> pieces_;          // the examples of every sample, sample after sample
  std::vector<size_t> sample_begin_;   // sample i holds pieces_[sample_begin_[i], sample_begin_[i + 1])
  int64_t truncated_ = 0, dropped_ = 0;
};

}  // namespace forge
