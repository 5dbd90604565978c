// IndexedDatasetWriter; see data/indexed_dataset.h and NOTE [Atomic dataset output] there.
#include <cstring>
#include <filesystem>
#include <limits>

#include "core/error.h"
#include "data/indexed_dataset.h"

namespace forge {

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
// Prepared datasets are not flushed to disk: NOTE [Durable files] in core/durable_file.h.
constexpr DurableOptions kDatasetDurability{.sync = false};
// Encoded tokens are written to .bin in pieces of about this size, not one per sequence.
constexpr size_t kWriteBytes = 1 << 20;

template <typename T> void append(std::vector<uint8_t>& bytes, T value) {
  uint8_t raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  bytes.insert(bytes.end(), raw, raw + sizeof(T));
}

template <typename T> bool fits(int32_t value) {
  return value >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
         value <= static_cast<int64_t>(std::numeric_limits<T>::max());
}

bool fits_dtype(int32_t value, IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::U8: return fits<uint8_t>(value);
    case IndexedDType::I8: return fits<int8_t>(value);
    case IndexedDType::I16: return fits<int16_t>(value);
    case IndexedDType::U16: return fits<uint16_t>(value);
    case IndexedDType::I32: case IndexedDType::I64: return true;
    case IndexedDType::F32: case IndexedDType::F64: return false;
  }
  return false;
}

void append_token(std::vector<uint8_t>& bytes, int32_t value, IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::U8: return append<uint8_t>(bytes, static_cast<uint8_t>(value));
    case IndexedDType::I8: return append<int8_t>(bytes, static_cast<int8_t>(value));
    case IndexedDType::I16: return append<int16_t>(bytes, static_cast<int16_t>(value));
    case IndexedDType::U16: return append<uint16_t>(bytes, static_cast<uint16_t>(value));
    case IndexedDType::I32: return append<int32_t>(bytes, value);
    case IndexedDType::I64: return append<int64_t>(bytes, value);
    case IndexedDType::F32: case IndexedDType::F64: break;
  }
}

}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, IndexedDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype), bin_(prefix_ + ".bin", kDatasetDurability) {
  if (dtype_ == IndexedDType::F32 || dtype_ == IndexedDType::F64)
    FORGE_FAIL("{}.bin: dtype {} cannot hold token ids", prefix_, indexed_dtype_name(dtype_));
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  add_sequence(tokens);
  end_document();
}

void IndexedDatasetWriter::add_sequence(std::span<const int32_t> tokens) {
  FORGE_CHECK(!finalized_, "{}: add_sequence after finalize", prefix_);
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    FORGE_FAIL("{}.bin: sequence {} has {} tokens, more than the format's int32 length allows", prefix_,
               sequence_lengths_.size(), tokens.size());
  const size_t sequence_start = buffer_.size();
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (!fits_dtype(tokens[i], dtype_)) {
      buffer_.resize(sequence_start);  // a rejected sequence leaves nothing to be written
      FORGE_FAIL("{}.bin: token {} of sequence {} is {}, which does not fit dtype {}", prefix_, i,
                 sequence_lengths_.size(), tokens[i], indexed_dtype_name(dtype_));
    }
    append_token(buffer_, tokens[i], dtype_);
  }
  if (buffer_.size() >= kWriteBytes) write_buffered_tokens();
  sequence_lengths_.push_back(static_cast<int32_t>(tokens.size()));
}

void IndexedDatasetWriter::write_buffered_tokens() {
  bin_.write(buffer_.data(), buffer_.size());
  buffer_.clear();
}

void IndexedDatasetWriter::end_document() {
  document_indices_.push_back(static_cast<int64_t>(sequence_lengths_.size()));
}

void IndexedDatasetWriter::write_index() {
  FORGE_CHECK(!finalized_, "{}: finalize called twice", prefix_);
  finalized_ = true;
  if (document_indices_.back() != static_cast<int64_t>(sequence_lengths_.size())) end_document();
  write_buffered_tokens();

  std::vector<uint8_t> index(kMagic, kMagic + sizeof(kMagic));
  append<uint64_t>(index, 1);
  append<uint8_t>(index, static_cast<uint8_t>(dtype_));
  append<uint64_t>(index, sequence_lengths_.size());
  append<uint64_t>(index, document_indices_.size());
  for (int32_t length : sequence_lengths_) append<int32_t>(index, length);
  int64_t pointer = 0;
  for (int32_t length : sequence_lengths_) {
    append<int64_t>(index, pointer);
    pointer += static_cast<int64_t>(length) * static_cast<int64_t>(indexed_dtype_size(dtype_));
  }
  for (int64_t document : document_indices_) append<int64_t>(index, document);

  idx_ = std::make_unique<AtomicFile>(prefix_ + ".idx", kDatasetDurability);
  idx_->write(index.data(), index.size());
}

void IndexedDatasetWriter::commit() {
  FORGE_CHECK(finalized_ && idx_, "{}: commit before write_index", prefix_);
  AtomicFile& idx = *idx_;

  // Into place, the previous .idx out of the way first: NOTE [Atomic dataset output].
  const std::string idx_path = prefix_ + ".idx", previous_idx = idx.temporary_path() + ".previous";
  std::error_code error;
  const bool had_previous = std::filesystem::exists(idx_path, error);
  if (had_previous) {
    std::filesystem::rename(idx_path, previous_idx, error);
    if (error) FORGE_FAIL("{}.idx: cannot replace: {}", prefix_, error.message());
  }
  try {
    bin_.commit();
  } catch (const Error&) {
    if (had_previous) std::filesystem::rename(previous_idx, idx_path, error);
    throw;
  }
  idx.commit();
  if (had_previous) std::filesystem::remove(previous_idx, error);
}

}  // namespace forge
