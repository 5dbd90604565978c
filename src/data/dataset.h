// Token datasets and the loader that turns them into training batches.
//
// A TokenDataset is a list of fixed-length samples of seq_len + 1 token ids (GPT style:
// inputs are the first seq_len, targets the last seq_len). Three sources implement it:
// mock (deterministic random tokens, as Megatron's --mock-data), synthetic (forge's
// built-in Markov corpus with a known entropy floor), and indexed (Megatron .bin/.idx
// documents packed into windows; one dataset, or a weighted blend of several).
//
// NOTE [Epochs and sample order]
// num_samples() counts the samples of one epoch. File-backed data (indexed) reshuffles
// its documents every epoch, so a sample is named by (epoch, index); generated sources
// (mock, synthetic) ignore the epoch. The DataLoader walks a global sample stream
// g = 0, 1, 2, ...: epoch = g / num_samples(), and within the epoch it visits samples in
// a seeded random order when the dataset asks for it (shuffle_samples()), else in order
// (generated samples are already random, and their epochs are too large to permute).
//
// NOTE [Example batches]
// Instruction data (sft_dataset.h) is made of examples, several packed into one sample or
// one padded, each token marked as a response token or not. Such a dataset says so
// (has_examples()) and gives, beside each of a sample's seq_len + 1 tokens, the example it
// belongs to (-1 for padding) and its response flag. The loader turns that into the batch:
// the target of input token i is token i + 1 only when both are in the same example and
// token i + 1 is a response token, else kIgnoreIndex (so the last token of an example never
// predicts the next example's first, and padding predicts nothing); positions count from 0
// in each example (and in the padding run); segments carry the example ids. Batches of
// other data leave positions and segments empty.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "ops/cross_entropy.h"  // kIgnoreIndex

namespace forge {

struct DataConfig {
  std::string source = "synthetic";  // synthetic | mock | indexed | sft | govreport_npy
  std::string path;                  // indexed, sft: path prefix of <path>.bin / <path>.idx (sft_dataset.h);
                                     // govreport_npy: the folder of train.npy, validation.npy (govreport_dataset.h)
  std::string blend;                 // indexed: "W1 PREFIX1 W2 PREFIX2 ..." instead of path (blended_dataset.h)
  std::string validation_path;       // indexed: prefix of a separate validation/test dataset, read whole,
                                     // unshuffled (NOTE [Separate validation data] in make_dataset.cpp)
  std::string split = "969,30,1";    // indexed, sft: train,validation,test weights (Megatron --split);
                                     // unused when validation_path is set
  std::string packing = "packed";    // sft: packed | padded (NOTE [SFT samples] in sft_dataset.h)
  std::string overlong = "truncate"; // sft: truncate | drop examples over seq_len + 1 tokens
  int64_t synthetic_order = 2;       // synthetic: Markov order (tokens of context)
  double synthetic_concentration = 0.1;  // synthetic: Dirichlet-like sharpness of transitions
  int64_t num_samples = 0;           // mock/synthetic: samples per epoch (0: effectively unbounded)
};

enum class Split { Train, Validation, Test };

std::string_view split_name(Split split);

class TokenDataset {
 public:
  virtual ~TokenDataset() = default;
  // Samples in one epoch.
  virtual int64_t num_samples() const = 0;
  virtual int64_t seq_len() const = 0;
  // Writes seq_len() + 1 token ids of sample `index` (0 <= index < num_samples()) of
  // epoch `epoch` (>= 0). See NOTE [Epochs and sample order].
  virtual void sample(int64_t epoch, int64_t index, int32_t* out) const = 0;
  // Whether the loader should visit this dataset's samples in a seeded random order.
  virtual bool shuffle_samples() const { return false; }
  // Whether samples are made of examples with response flags (NOTE [Example batches]).
  virtual bool has_examples() const { return false; }
  // Writes sample() 's seq_len() + 1 tokens and, for each, its example (0, 1, ... in the
  // sample; -1 for padding) and whether it is a response token. Without examples: one
  // example of response tokens.
  virtual void sample_examples(int64_t epoch, int64_t index, int32_t* tokens, int32_t* example,
                               uint8_t* response) const;
  // Best achievable mean cross-entropy in nats per target token, when known (mock and
  // synthetic data); -1 when unknown.
  virtual double entropy_floor() const { return -1.0; }
};

// Builds the dataset for a split. vocab_size is the model's; token ids >= vocab_size in
// files are rejected with an error naming the file and position.
std::unique_ptr<TokenDataset> make_dataset(const DataConfig& config, Split split, int64_t seq_len,
                                           int64_t vocab_size, uint64_t seed);

// The entropy floor (nats per target token) of the training data make_dataset would
// build, without reading any file: exact for synthetic and mock data, -1 for indexed.
double data_entropy_floor(const DataConfig& config, int64_t seq_len, int64_t vocab_size,
                          uint64_t seed);

struct Batch {
  Tensor tokens;   // int32 [micro_batch, seq_len]
  Tensor targets;  // int32 [micro_batch, seq_len]; kIgnoreIndex where no target
  // Data with examples only (NOTE [Example batches]), else empty:
  Tensor positions;  // int32 [micro_batch, seq_len]: each token's position within its example
  Tensor segments;   // int32 [micro_batch, seq_len]: its example's id (-1: padding)
  bool has_examples() const { return positions.defined(); }
};

// Iterates over a dataset epoch after epoch. Each next() consumes one block of
// micro_batch * world consecutive samples of the global stream; rank r takes samples
// r, r + world, ... of the block, so that the union of all ranks' micro-batches (and so
// the global batch) is the same at every world size.
class DataLoader {
 public:
  // Of every `world` consecutive micro-batches of the global stream, rank `rank` reads the
  // rank-th (samples position + rank * micro_batch + row) and nothing else: the batch a
  // single reader's rank-th next() would return, so the ranks together read the global
  // batch once, in a single reader's order (NOTE [Data-parallel steps]).
  DataLoader(const TokenDataset& dataset, int64_t micro_batch, uint64_t seed, int rank = 0, int world = 1);
  Batch next();
  // Samples consumed so far by all ranks together (the same on every rank): the
  // position to save for checkpoint resume.
  int64_t position() const { return position_; }
  void set_position(int64_t position);

 private:
  int64_t sample_in_epoch(int64_t epoch, int64_t index);
  void fill_example_row(int64_t epoch, int64_t index, int64_t row, Batch& batch);

  const TokenDataset& dataset_;
  int64_t micro_batch_;
  uint64_t seed_;
  int rank_, world_;
  int64_t position_ = 0;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> order_;
};

}  // namespace forge
