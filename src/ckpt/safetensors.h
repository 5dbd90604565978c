// safetensors: the tensor file format of Hugging Face checkpoints, read and written.
//
//   [8 bytes: N, little-endian u64] [N bytes: JSON header] [data section]
//
// The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]}
// (byte offsets into the data section) plus an optional "__metadata__" map of strings.
//
// NOTE [Strict safetensors parsing]
// A model file is untrusted input: the reader never reads past the file and rejects
// anything the specification does not allow before any tensor is used. N must fit in the
// file and stay under 100 MB (the reference implementation's limit); the header must be a
// UTF-8 JSON object without duplicate names, with nothing around it but JSON whitespace
// (no NUL padding, no byte-order mark: tests/python/test_safetensors_strictness.py checks
// forge accepts exactly what the reference reader accepts); every dtype must be known, every shape a list
// of non-negative integers, and end - begin must equal numel × dtype size; sorted by begin,
// the tensors must tile the data section exactly (no overlap, no gap, no trailing bytes),
// which is also what catches a truncated file. Each error names the file, the tensor and
// the offending value.
//
// The writer produces what the reference library produces: a compact header padded with
// spaces so the data section starts 8-byte aligned, "__metadata__" first, tensors laid
// out in the order given, written to a temporary file and renamed into place.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"
#include "data/mapped_file.h"

namespace forge {

enum class SafetensorsDType : uint8_t { BOOL, U8, I8, F8_E5M2, F8_E4M3, I16, U16, F16, BF16, I32, U32, F32, F64, I64, U64 };

size_t safetensors_dtype_size(SafetensorsDType dtype);
std::string_view safetensors_dtype_name(SafetensorsDType dtype);
std::optional<SafetensorsDType> parse_safetensors_dtype(std::string_view name);

constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

struct SafetensorsEntry {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::F32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets into the data section
  uint64_t end = 0;
  int64_t numel() const { return shape_numel(shape); }
};

// A validated, memory-mapped safetensors file.
class SafetensorsFile {
 public:
  // Throws forge::Error naming the path (and tensor) when the file is not valid safetensors.
  explicit SafetensorsFile(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Every tensor, in data-section order.
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // nullptr when the file holds no tensor of that name.
  const SafetensorsEntry* find(const std::string& name) const;
  // The tensor's bytes as stored (little-endian, possibly unaligned).
  const uint8_t* bytes(const SafetensorsEntry& entry) const { return data_section_ + entry.begin; }
  // Converts an F32, BF16, F16 or F64 tensor to fp32 into out (entry.numel() floats);
  // other dtypes are an error naming the tensor.
  void read_as_float(const SafetensorsEntry& entry, float* out) const;
  // The same for its elements [first, first + count) only (a tensor-parallel rank's shard).
  void read_as_float(const SafetensorsEntry& entry, float* out, int64_t first, int64_t count) const;

 private:
  void parse_header(std::string_view header, uint64_t data_bytes);
  void check_layout(uint64_t data_bytes);

  MappedFile file_;
  const uint8_t* data_section_ = nullptr;
  std::map<std::string, std::string> metadata_;
  std::vector<SafetensorsEntry> entries_;
  std::unordered_map<std::string, size_t> by_name_;
};

// One fp32 tensor to write, borrowed from the caller.
struct SafetensorsTensorRef {
  std::string name;
  Shape shape;
  const float* data = nullptr;
  // Row r of the tensor (along dim 0) is row row_order[r] of `data`; empty: row r.
  std::vector<int64_t> row_order = {};
  // Stored as this instead of the file's dtype (F32, BF16 or F16).
  std::optional<SafetensorsDType> stored = std::nullopt;
};

// Writes the tensors, stored as `stored` (F32, BF16 or F16, converted from fp32 with
// round-to-nearest-even) unless a tensor says otherwise, in the given order, atomically
// (an AtomicFile: NOTE [Durable files] in core/durable_file.h).
void write_safetensors(const std::string& path, const std::vector<SafetensorsTensorRef>& tensors,
                       SafetensorsDType stored, const std::map<std::string, std::string>& metadata);

// The header write_safetensors writes for these tensors (their shapes, names and dtypes; the
// data pointers are not read): the JSON, padded so that the data section starts 8-byte
// aligned, without the 8-byte length before it. Tensor i's bytes follow one another from
// data-section offset 0 in the order given.
std::string safetensors_header(const std::vector<SafetensorsTensorRef>& tensors, SafetensorsDType stored,
                               const std::map<std::string, std::string>& metadata);

}  // namespace forge
