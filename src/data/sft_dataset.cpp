#include "data/sft_dataset.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/log.h"
#include "core/rng.h"
#include "data/packed_dataset.h"

namespace forge {

namespace {

constexpr uint64_t kExampleOrderStream = 0x5F7E0;

// The mask dataset must be the token dataset's twin: uint8 values 0/1, the same sequences
// and documents.
void validate_mask(const IndexedDataset& tokens, const IndexedDataset& mask) {
  if (mask.dtype() != IndexedDType::U8)
    FORGE_FAIL("{}: the loss mask has dtype {}: expected uint8", mask.idx_path(), indexed_dtype_name(mask.dtype()));
  if (mask.num_sequences() != tokens.num_sequences() || mask.num_documents() != tokens.num_documents())
    FORGE_FAIL("{}: {} sequences in {} documents, but {} has {} in {}: expected the same", mask.idx_path(),
               mask.num_sequences(), mask.num_documents(), tokens.idx_path(), tokens.num_sequences(),
               tokens.num_documents());
  for (int64_t d = 0; d <= tokens.num_documents(); ++d)
    if (mask.document_index(d) != tokens.document_index(d))
      FORGE_FAIL("{}: document index {} is {}, but {} in {}: expected the same", mask.idx_path(), d,
                 mask.document_index(d), tokens.document_index(d), tokens.idx_path());
  for (int64_t s = 0; s < tokens.num_sequences(); ++s) {
    if (mask.sequence_length(s) != tokens.sequence_length(s))
      FORGE_FAIL("{}: sequence {} has {} mask values, {} has {} tokens: expected the same", mask.idx_path(), s,
                 mask.sequence_length(s), tokens.idx_path(), tokens.sequence_length(s));
    for (int64_t p = 0; p < mask.sequence_length(s); ++p) {
      const int64_t value = mask.token(s, p);
      if (value != 0 && value != 1)
        FORGE_FAIL("{}: byte offset {} (token {} of sequence {}) holds {}: expected a loss mask value 0 or 1",
                   mask.bin_path(), mask.sequence_pointer(s) + p, p, s, value);
    }
  }
}

}  // namespace

SftDataset::SftDataset(const std::string& prefix, const std::string& split, Split which, int64_t seq_len,
                       int64_t vocab_size, uint64_t seed, SftOptions options)
    : tokens_(prefix), mask_(prefix + ".mask"), seq_len_(seq_len), vocab_size_(vocab_size) {
  validate_mask(tokens_, mask_);
  const SequenceRange range = split_sequence_range(split, which, tokens_.num_sequences());
  std::vector<int64_t> order(static_cast<size_t>(range.end - range.begin));
  std::iota(order.begin(), order.end(), range.begin);
  Rng rng(derive_seed(seed, kExampleOrderStream));
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);

  const int64_t capacity = seq_len + 1;
  int64_t empty = 0, response_targets = 0, used = capacity;  // `used`: tokens in the open sample
  for (int64_t sequence : order) {
    int64_t length = tokens_.sequence_length(sequence);
    if (length == 0) {
      ++empty;
      continue;
    }
    if (length > capacity) {
      if (options.drop_overlong) {
        ++dropped_;
        continue;
      }
      ++truncated_;
      length = capacity;
    }
    for (int64_t p = 1; p < length; ++p) response_targets += mask_.token(sequence, p);
    if (!options.packed || used + length > capacity) {
      sample_begin_.push_back(pieces_.size());
      used = 0;
    }
    pieces_.push_back({sequence, length});
    used += length;
  }
  sample_begin_.push_back(pieces_.size());
  dropped_ += empty;
  log_info("data: {} split of {}: {} examples in {} {} samples of seq_len + 1 = {} tokens", split_name(which), prefix,
           pieces_.size(), sample_begin_.size() - 1, options.packed ? "packed" : "padded", capacity);
  if (truncated_ + dropped_ > 0)
    log_info("data: {} split of {}: {} examples over seq_len + 1 = {} tokens {}, {} empty ones skipped",
             split_name(which), prefix, options.drop_overlong ? dropped_ - empty : truncated_, capacity,
             options.drop_overlong ? "dropped" : "truncated", empty);
  if (pieces_.empty())
    FORGE_FAIL("{}: the {} split (sequences [{}, {})) keeps no example of at most seq_len + 1 = {} tokens",
               tokens_.idx_path(), split_name(which), range.begin, range.end, capacity);
  if (response_targets == 0)
    FORGE_FAIL("{}: the {} split's examples have no response token after their first (mask 1): nothing to train on",
               mask_.bin_path(), split_name(which));
}

void SftDataset::sample_examples(int64_t epoch, int64_t index, int32_t* tokens, int32_t* example,
                                 uint8_t* response) const {
  FORGE_CHECK(index >= 0 && index < num_samples() && epoch >= 0, "sample {} of {} in epoch {}", index, num_samples(),
              epoch);
  int64_t at = 0;
  for (size_t k = sample_begin_[static_cast<size_t>(index)]; k < sample_begin_[static_cast<size_t>(index) + 1]; ++k) {
    const Piece& piece = pieces_[k];
    tokens_.read_tokens(piece.sequence, 0, piece.length, vocab_size_, tokens + at);
    for (int64_t p = 0; p < piece.length; ++p) {
      example[at + p] = static_cast<int32_t>(k - sample_begin_[static_cast<size_t>(index)]);
      response[at + p] = static_cast<uint8_t>(mask_.token(piece.sequence, p));
    }
    at += piece.length;
  }
  std::fill(tokens + at, tokens + seq_len_ + 1, 0);
  std::fill(example + at, example + seq_len_ + 1, -1);
  std::fill(response + at, response + seq_len_ + 1, uint8_t{0});
}

void SftDataset::sample(int64_t epoch, int64_t index, int32_t* out) const {
  std::vector<int32_t> example(static_cast<size_t>(seq_len_ + 1));
  std::vector<uint8_t> response(example.size());
  sample_examples(epoch, index, out, example.data(), response.data());
}

}  // namespace forge
