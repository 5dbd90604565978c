#include "data/indexed_dataset.h"

#include <bit>
#include <cstring>

#include "core/error.h"

namespace forge {

static_assert(std::endian::native == std::endian::little,
              "the .bin/.idx format is little-endian and read in place");

namespace {

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kVersionOffset = 9;
constexpr size_t kDTypeOffset = 17;
constexpr size_t kSequenceCountOffset = 18;
constexpr size_t kDocumentCountOffset = 26;
constexpr size_t kHeaderSize = 34;

template <typename T> T load(const uint8_t* base, size_t offset) {
  T value;
  std::memcpy(&value, base + offset, sizeof(T));
  return value;
}

bool is_known_code(uint8_t code) { return code >= 1 && code <= 8; }

bool holds_token_ids(IndexedDType dtype) {
  return dtype != IndexedDType::F32 && dtype != IndexedDType::F64;
}

}  // namespace

size_t indexed_dtype_size(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::U8: case IndexedDType::I8: return 1;
    case IndexedDType::I16: case IndexedDType::U16: return 2;
    case IndexedDType::I32: case IndexedDType::F32: return 4;
    case IndexedDType::I64: case IndexedDType::F64: return 8;
  }
  return 0;
}

std::string_view indexed_dtype_name(IndexedDType dtype) {
  switch (dtype) {
    case IndexedDType::U8: return "uint8";
    case IndexedDType::I8: return "int8";
    case IndexedDType::I16: return "int16";
    case IndexedDType::I32: return "int32";
    case IndexedDType::I64: return "int64";
    case IndexedDType::F64: return "float64";
    case IndexedDType::F32: return "float32";
    case IndexedDType::U16: return "uint16";
  }
  return "?";
}

IndexedDType indexed_dtype_from_name(std::string_view name) {
  for (uint8_t code = 1; code <= 8; ++code) {
    auto dtype = static_cast<IndexedDType>(code);
    if (holds_token_ids(dtype) && indexed_dtype_name(dtype) == name) return dtype;
  }
  FORGE_FAIL("unknown token dtype '{}': expected uint8, int8, int16, uint16, int32 or int64", name);
}

IndexedDataset::IndexedDataset(const std::string& prefix) : idx_(prefix + ".idx"), bin_(prefix + ".bin") {
  validate_header();
  validate_sequences();
  validate_document_indices();
}

void IndexedDataset::validate_header() {
  const std::string& path = idx_.path();
  const uint8_t* p = idx_.data();
  size_t size = idx_.size();
  if (size < kHeaderSize)
    FORGE_FAIL("{}: truncated index: {} bytes, expected a header of {} bytes", path, size, kHeaderSize);
  if (std::memcmp(p, kMagic, sizeof(kMagic)) != 0)
    FORGE_FAIL("{}: bad magic at byte offset 0: expected \"MMIDIDX\\x00\\x00\" (a Megatron indexed dataset index)",
               path);
  uint64_t version = load<uint64_t>(p, kVersionOffset);
  if (version != 1)
    FORGE_FAIL("{}: unsupported version {} at byte offset {}: expected 1", path, version, kVersionOffset);
  uint8_t code = p[kDTypeOffset];
  if (!is_known_code(code))
    FORGE_FAIL("{}: unknown dtype code {} at byte offset {}: expected 1..8 (megatron-core DType)", path, code,
               kDTypeOffset);
  dtype_ = static_cast<IndexedDType>(code);
  if (!holds_token_ids(dtype_))
    FORGE_FAIL("{}: dtype code {} ({}) at byte offset {} cannot hold token ids: expected an integer dtype", path,
               code, indexed_dtype_name(dtype_), kDTypeOffset);
  token_size_ = indexed_dtype_size(dtype_);

  uint64_t sequences = load<uint64_t>(p, kSequenceCountOffset);
  uint64_t documents = load<uint64_t>(p, kDocumentCountOffset);
  if (sequences > size || documents > size)
    FORGE_FAIL("{}: truncated index: sequence count {} (byte offset {}) and document count {} (byte offset {}) "
               "do not fit in its {} bytes",
               path, sequences, kSequenceCountOffset, documents, kDocumentCountOffset, size);
  uint64_t expected = kHeaderSize + 12 * sequences + 8 * documents;
  if (size < expected)
    FORGE_FAIL("{}: truncated index: {} sequences and {} document indices need {} bytes, the file has {}", path,
               sequences, documents, expected, size);
  if (size == expected + sequences && sequences > 0)
    FORGE_FAIL("{}: {} bytes of sequence modes after byte offset {}: multimodal indexed datasets are not supported",
               path, sequences, expected);
  if (size > expected)
    FORGE_FAIL("{}: {} unexpected bytes after byte offset {} ({} sequences, {} document indices)", path,
               size - expected, expected, sequences, documents);
  if (documents == 0)
    FORGE_FAIL("{}: document count 0 at byte offset {}: expected at least 1 (the leading 0 boundary)", path,
               kDocumentCountOffset);
  num_sequences_ = static_cast<int64_t>(sequences);
  num_document_indices_ = static_cast<int64_t>(documents);
  lengths_offset_ = kHeaderSize;
  pointers_offset_ = lengths_offset_ + 4 * sequences;
  documents_offset_ = pointers_offset_ + 8 * sequences;
}

void IndexedDataset::validate_sequences() {
  for (int64_t i = 0; i < num_sequences_; ++i) {
    size_t length_offset = lengths_offset_ + 4 * static_cast<size_t>(i);
    size_t pointer_offset = pointers_offset_ + 8 * static_cast<size_t>(i);
    int32_t length = load<int32_t>(idx_.data(), length_offset);
    int64_t pointer = load<int64_t>(idx_.data(), pointer_offset);
    if (length < 0)
      FORGE_FAIL("{}: sequence {} has negative length {} at byte offset {}", idx_.path(), i, length, length_offset);
    if (pointer < 0 || pointer % static_cast<int64_t>(token_size_) != 0)
      FORGE_FAIL("{}: sequence {} has pointer {} at byte offset {}: expected a non-negative multiple of {} ({})",
                 idx_.path(), i, pointer, pointer_offset, token_size_, indexed_dtype_name(dtype_));
    uint64_t end = static_cast<uint64_t>(pointer) + static_cast<uint64_t>(length) * token_size_;
    if (end > bin_.size())
      FORGE_FAIL("{}: sequence {} (pointer at byte offset {}, length at byte offset {}) covers bytes [{}, {}) of {}, "
                 "past its end ({} bytes)",
                 idx_.path(), i, pointer_offset, length_offset, pointer, end, bin_.path(), bin_.size());
  }
}

void IndexedDataset::validate_document_indices() {
  int64_t previous = 0;
  for (int64_t i = 0; i < num_document_indices_; ++i) {
    size_t offset = documents_offset_ + 8 * static_cast<size_t>(i);
    int64_t value = load<int64_t>(idx_.data(), offset);
    if (i == 0 && value != 0)
      FORGE_FAIL("{}: document index 0 is {} at byte offset {}: expected 0", idx_.path(), value, offset);
    if (value < previous || value > num_sequences_)
      FORGE_FAIL("{}: document index {} is {} at byte offset {}: expected non-decreasing values in [{}, {}]",
                 idx_.path(), i, value, offset, previous, num_sequences_);
    previous = value;
  }
  if (previous != num_sequences_)
    FORGE_FAIL("{}: last document index is {} at byte offset {}: expected the sequence count {}", idx_.path(),
               previous, documents_offset_ + 8 * static_cast<size_t>(num_document_indices_ - 1), num_sequences_);
}

int64_t IndexedDataset::sequence_length(int64_t sequence) const {
  FORGE_CHECK(sequence >= 0 && sequence < num_sequences_, "sequence {} of {}", sequence, num_sequences_);
  return load<int32_t>(idx_.data(), lengths_offset_ + 4 * static_cast<size_t>(sequence));
}

int64_t IndexedDataset::sequence_pointer(int64_t sequence) const {
  FORGE_CHECK(sequence >= 0 && sequence < num_sequences_, "sequence {} of {}", sequence, num_sequences_);
  return load<int64_t>(idx_.data(), pointers_offset_ + 8 * static_cast<size_t>(sequence));
}

int64_t IndexedDataset::document_index(int64_t i) const {
  FORGE_CHECK(i >= 0 && i < num_document_indices_, "document index {} of {}", i, num_document_indices_);
  return load<int64_t>(idx_.data(), documents_offset_ + 8 * static_cast<size_t>(i));
}

int64_t IndexedDataset::token_at_byte(size_t byte_offset) const {
  const uint8_t* p = bin_.data();
  switch (dtype_) {
    case IndexedDType::U8: return load<uint8_t>(p, byte_offset);
    case IndexedDType::I8: return load<int8_t>(p, byte_offset);
    case IndexedDType::I16: return load<int16_t>(p, byte_offset);
    case IndexedDType::U16: return load<uint16_t>(p, byte_offset);
    case IndexedDType::I32: return load<int32_t>(p, byte_offset);
    case IndexedDType::I64: return load<int64_t>(p, byte_offset);
    case IndexedDType::F32: case IndexedDType::F64: break;
  }
  FORGE_CHECK(false, "dtype {} holds no token ids", indexed_dtype_name(dtype_));
  return 0;
}

int64_t IndexedDataset::token(int64_t sequence, int64_t position) const {
  FORGE_CHECK(position >= 0 && position < sequence_length(sequence), "token {} of sequence {} (length {})", position,
              sequence, sequence_length(sequence));
  return token_at_byte(static_cast<size_t>(sequence_pointer(sequence)) + static_cast<size_t>(position) * token_size_);
}

void IndexedDataset::read_tokens(int64_t sequence, int64_t offset, int64_t count, int64_t vocab_size,
                                 int32_t* out) const {
  FORGE_CHECK(offset >= 0 && count >= 0 && offset + count <= sequence_length(sequence),
              "tokens [{}, {}) of sequence {} (length {})", offset, offset + count, sequence,
              sequence_length(sequence));
  size_t byte = static_cast<size_t>(sequence_pointer(sequence)) + static_cast<size_t>(offset) * token_size_;
  for (int64_t i = 0; i < count; ++i, byte += token_size_) {
    int64_t id = token_at_byte(byte);
    if (id < 0 || id >= vocab_size)
      FORGE_FAIL("{}: token id {} at byte offset {} (sequence {}, token {}) is outside the model's vocabulary "
                 "[0, {})",
                 bin_.path(), id, byte, sequence, offset + i, vocab_size);
    out[i] = static_cast<int32_t>(id);
  }
}

}  // namespace forge
