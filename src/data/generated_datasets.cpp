#include "data/generated_datasets.h"

#include <cmath>

#include "core/error.h"
#include "core/rng.h"

namespace forge {

MockDataset::MockDataset(int64_t seq_len, int64_t vocab_size, int64_t num_samples, uint64_t split_seed)
    : seq_len_(seq_len), vocab_size_(vocab_size), num_samples_(num_samples), split_seed_(split_seed) {}

void MockDataset::sample(int64_t epoch, int64_t index, int32_t* out) const {
  FORGE_CHECK(index >= 0 && index < num_samples_, "sample {} of {}", index, num_samples_);
  Rng rng(derive_seed(split_seed_, static_cast<uint64_t>(index)));
  for (int64_t i = 0; i <= seq_len_; ++i) out[i] = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab_size_)));
}

double MockDataset::entropy_floor() const { return std::log(static_cast<double>(vocab_size_)); }

SyntheticDataset::SyntheticDataset(std::shared_ptr<const MarkovSource> source, int64_t seq_len, int64_t num_samples,
                                   uint64_t split_seed)
    : source_(std::move(source)), seq_len_(seq_len), num_samples_(num_samples), split_seed_(split_seed) {}

void SyntheticDataset::sample(int64_t epoch, int64_t index, int32_t* out) const {
  FORGE_CHECK(index >= 0 && index < num_samples_, "sample {} of {}", index, num_samples_);
  Rng rng(derive_seed(split_seed_, static_cast<uint64_t>(index)));
  source_->generate(rng, seq_len_ + 1, out);
}

}  // namespace forge
