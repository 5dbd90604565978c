// Token datasets and the loader that turns them into training batches.
//
// A TokenDataset is a list of fixed-length samples of seq_len + 1 token ids (GPT style:
// inputs are the first seq_len, targets the last seq_len). Three sources implement it:
// mock (deterministic random tokens, as Megatron's --mock-data), synthetic (forge's
// built-in Markov corpus with a known entropy floor), and indexed (Megatron .bin/.idx
// documents packed into windows).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace forge {

struct DataConfig {
  std::string source = "synthetic";  // synthetic | mock | indexed
  std::string path;                  // indexed: path prefix of <path>.bin / <path>.idx
  std::string split = "969,30,1";    // indexed: train,validation,test weights (Megatron --split)
  int64_t synthetic_order = 2;       // synthetic: Markov order (tokens of context)
  double synthetic_concentration = 0.1;  // synthetic: Dirichlet-like sharpness of transitions
  int64_t num_samples = 0;           // mock/synthetic: samples per epoch (0: effectively unbounded)
};

enum class Split { Train, Validation, Test };

class TokenDataset {
 public:
  virtual ~TokenDataset() = default;
  virtual int64_t num_samples() const = 0;
  virtual int64_t seq_len() const = 0;
  // Writes seq_len() + 1 token ids of sample `index` (0 <= index < num_samples()).
  virtual void sample(int64_t index, int32_t* out) const = 0;
  // Best achievable mean cross-entropy in nats per token, when known (synthetic data).
  virtual double entropy_floor() const { return -1.0; }
};

// Builds the dataset for a split. vocab_size is the model's; token ids >= vocab_size in
// files are rejected with an error naming the file and position.
std::unique_ptr<TokenDataset> make_dataset(const DataConfig& config, Split split, int64_t seq_len,
                                           int64_t vocab_size, uint64_t seed);

struct Batch {
  Tensor tokens;   // int32 [micro_batch, seq_len]
  Tensor targets;  // int32 [micro_batch, seq_len]; kIgnoreIndex where no target
};

constexpr int32_t kIgnoreIndex = -100;

// Iterates over a dataset in a seeded shuffled order, epoch after epoch. Rank r of a
// data-parallel world reads samples r, r + world, ... of every global batch so that the
// global batch means the same at every world size.
class DataLoader {
 public:
  DataLoader(const TokenDataset& dataset, int64_t micro_batch, uint64_t seed, int rank = 0, int world = 1);
  Batch next();
  // Samples consumed so far by this loader (its position, for checkpoint resume).
  int64_t position() const { return position_; }
  void set_position(int64_t position) { position_ = position; }

 private:
  int64_t sample_index(int64_t global_position) const;

  const TokenDataset& dataset_;
  int64_t micro_batch_;
  uint64_t seed_;
  int rank_, world_;
  int64_t position_ = 0;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> order_;
};

}  // namespace forge
