// The safetensors reader: parse and validate the header (NOTE [Strict safetensors
// parsing] in safetensors.h), then hand out tensors straight from the memory map.
#include "ckpt/safetensors.h"

#include <algorithm>
#include <array>
#include <bit>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/half_float.h"
#include "core/json_input.h"

namespace forge {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

struct DTypeInfo {
  SafetensorsDType dtype;
  std::string_view name;
  size_t size;
};

constexpr std::array<DTypeInfo, 15> kDTypes = {{
    {SafetensorsDType::BOOL, "BOOL", 1},       {SafetensorsDType::U8, "U8", 1},
    {SafetensorsDType::I8, "I8", 1},           {SafetensorsDType::F8_E5M2, "F8_E5M2", 1},
    {SafetensorsDType::F8_E4M3, "F8_E4M3", 1}, {SafetensorsDType::I16, "I16", 2},
    {SafetensorsDType::U16, "U16", 2},         {SafetensorsDType::F16, "F16", 2},
    {SafetensorsDType::BF16, "BF16", 2},       {SafetensorsDType::I32, "I32", 4},
    {SafetensorsDType::U32, "U32", 4},         {SafetensorsDType::F32, "F32", 4},
    {SafetensorsDType::F64, "F64", 8},         {SafetensorsDType::I64, "I64", 8},
    {SafetensorsDType::U64, "U64", 8},
}};

const DTypeInfo& info(SafetensorsDType dtype) {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d;
  FORGE_CHECK(false, "unknown SafetensorsDType {}", static_cast<int>(dtype));
}

std::string known_dtype_names() {
  std::string out;
  for (const auto& d : kDTypes) out += (out.empty() ? "" : ", ") + std::string(d.name);
  return out;
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Parses the header text, rejecting a repeated top-level name (a plain parse would keep
// the last one silently).
nlohmann::json parse_header_json(std::string_view text, const std::string& path) {
  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && duplicate.empty() &&
        !seen.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  // NOTE [Strict safetensors parsing]: the reference reader (serde_json) takes JSON with
  // surrounding whitespace and nothing else. nlohmann stops at a NUL byte as if the input
  // ended there and skips a UTF-8 byte-order mark; serde_json rejects both.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    FORGE_FAIL("{}: header holds a NUL byte at offset {} (pad a header with spaces, not NUL bytes)", path, 8 + nul);
  if (text.starts_with("\xEF\xBB\xBF")) FORGE_FAIL("{}: header starts with a UTF-8 byte-order mark", path);
  check_json_depth(text, path);
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text.begin(), text.end(), on_event);
  } catch (const nlohmann::json::exception& e) {
    FORGE_FAIL("{}: header is not valid UTF-8 JSON: {}", path, e.what());
  }
  if (!duplicate.empty()) FORGE_FAIL("{}: header names '{}' more than once", path, duplicate);
  if (!header.is_object()) FORGE_FAIL("{}: header is JSON {}, expected an object", path, header.type_name());
  return header;
}

// numel × element size, failing on overflow of either product.
uint64_t tensor_bytes(const Shape& shape, size_t element_size, const std::string& path, const std::string& name) {
  uint64_t bytes = element_size;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes))
      FORGE_FAIL("{}: tensor '{}': shape {} is too large", path, name, shape_str(shape));
  if (bytes / element_size > static_cast<uint64_t>(INT64_MAX))
    FORGE_FAIL("{}: tensor '{}': shape {} is too large", path, name, shape_str(shape));
  return bytes;
}

}  // namespace

size_t safetensors_dtype_size(SafetensorsDType dtype) { return info(dtype).size; }
std::string_view safetensors_dtype_name(SafetensorsDType dtype) { return info(dtype).name; }

std::optional<SafetensorsDType> parse_safetensors_dtype(std::string_view name) {
  for (const auto& d : kDTypes)
    if (d.name == name) return d.dtype;
  return std::nullopt;
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const uint64_t size = file_.size();
  if (size < 8) FORGE_FAIL("{}: file is {} bytes, too short for the 8-byte header length", path, size);
  const uint64_t header_bytes = read_u64_le(file_.data());
  if (header_bytes > kSafetensorsMaxHeaderBytes)
    FORGE_FAIL("{}: header length {} exceeds the {} byte limit (not a safetensors file?)", path, header_bytes,
               kSafetensorsMaxHeaderBytes);
  if (header_bytes > size - 8)
    FORGE_FAIL("{}: header length {} runs past the end of the file ({} bytes after the length field)", path,
               header_bytes, size - 8);
  const char* header_text = reinterpret_cast<const char*>(file_.data() + 8);
  data_section_ = file_.data() + 8 + header_bytes;
  const uint64_t data_bytes = size - 8 - header_bytes;
  parse_header(std::string_view(header_text, header_bytes), data_bytes);
  check_layout(data_bytes);
  for (size_t i = 0; i < entries_.size(); ++i) by_name_.emplace(entries_[i].name, i);
}

void SafetensorsFile::parse_header(std::string_view text, uint64_t data_bytes) {
  const std::string& p = path();
  nlohmann::json header = parse_header_json(text, p);
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) FORGE_FAIL("{}: __metadata__ is JSON {}, expected an object of strings", p, value.type_name());
      for (const auto& [key, v] : value.items()) {
        if (!v.is_string())
          FORGE_FAIL("{}: __metadata__ entry '{}' is JSON {}, expected a string", p, key, v.type_name());
        metadata_[key] = v.get<std::string>();
      }
      continue;
    }
    if (!value.is_object()) FORGE_FAIL("{}: tensor '{}' is JSON {}, expected an object", p, name, value.type_name());
    for (const char* key : {"dtype", "shape", "data_offsets"})
      if (!value.contains(key)) FORGE_FAIL("{}: tensor '{}' has no \"{}\"", p, name, key);
    SafetensorsEntry e;
    e.name = name;
    const auto& dtype = value["dtype"];
    std::optional<SafetensorsDType> parsed = dtype.is_string() ? parse_safetensors_dtype(dtype.get<std::string>())
                                                               : std::nullopt;
    if (!parsed) FORGE_FAIL("{}: tensor '{}': unknown dtype {} (expected one of {})", p, name, describe_json(dtype), known_dtype_names());
    e.dtype = *parsed;
    const auto& shape = value["shape"];
    if (!shape.is_array()) FORGE_FAIL("{}: tensor '{}': shape {} is not a list", p, name, describe_json(shape));
    for (const auto& d : shape) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        FORGE_FAIL("{}: tensor '{}': shape {} has a dimension that is not a non-negative integer", p, name, describe_json(shape));
      e.shape.push_back(d.get<int64_t>());
    }
    const auto& offsets = value["data_offsets"];
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      FORGE_FAIL("{}: tensor '{}': data_offsets {} is not [begin, end] with non-negative integers", p, name,
                 describe_json(offsets));
    e.begin = offsets[0].get<uint64_t>();
    e.end = offsets[1].get<uint64_t>();
    if (e.end < e.begin) FORGE_FAIL("{}: tensor '{}': data_offsets [{}, {}] end before begin", p, name, e.begin, e.end);
    const uint64_t expected = tensor_bytes(e.shape, safetensors_dtype_size(e.dtype), p, name);
    if (e.end - e.begin != expected)
      FORGE_FAIL("{}: tensor '{}': data_offsets [{}, {}] span {} bytes, but {} {} needs {}", p, name, e.begin, e.end,
                 e.end - e.begin, safetensors_dtype_name(e.dtype), shape_str(e.shape), expected);
    if (e.end > data_bytes)
      FORGE_FAIL("{}: tensor '{}': data_offsets [{}, {}] end past the data section ({} bytes); the file is truncated "
                 "or the offsets are wrong",
                 p, name, e.begin, e.end, data_bytes);
    entries_.push_back(std::move(e));
  }
}

void SafetensorsFile::check_layout(uint64_t data_bytes) {
  std::stable_sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const auto& e : entries_) {
    if (e.begin < covered)
      FORGE_FAIL("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", path(), e.name, e.begin, e.end,
                 previous->name, previous->begin, previous->end);
    if (e.begin > covered)
      FORGE_FAIL("{}: tensor '{}': data_offsets [{}, {}] leave bytes [{}, {}) of the data section unused", path(),
                 e.name, e.begin, e.end, covered, e.begin);
    covered = e.end;
    previous = &e;
  }
  if (covered != data_bytes)
    FORGE_FAIL("{}: the tensors cover {} bytes of the {}-byte data section; {} trailing bytes belong to no tensor",
               path(), covered, data_bytes, data_bytes - covered);
}

const SafetensorsEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

void SafetensorsFile::read_as_float(const SafetensorsEntry& entry, float* out) const {
  read_as_float(entry, out, 0, entry.numel());
}

void SafetensorsFile::read_as_float(const SafetensorsEntry& entry, float* out, int64_t first, int64_t count) const {
  FORGE_CHECK(first >= 0 && count >= 0 && first + count <= entry.numel(), "{}: elements [{}, {}) of tensor '{}' ({})",
              path(), first, first + count, entry.name, entry.numel());
  const uint8_t* src = bytes(entry) + static_cast<size_t>(first) * safetensors_dtype_size(entry.dtype);
  const int64_t n = count;
  switch (entry.dtype) {
    case SafetensorsDType::F32:
      std::memcpy(out, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case SafetensorsDType::BF16:
    case SafetensorsDType::F16: {
      const bool bf16 = entry.dtype == SafetensorsDType::BF16;
      for (int64_t i = 0; i < n; ++i) {
        uint16_t bits;
        std::memcpy(&bits, src + 2 * i, sizeof(bits));
        out[i] = bf16 ? bf16_to_float(bits) : f16_to_float(bits);
      }
      return;
    }
    case SafetensorsDType::F64:
      for (int64_t i = 0; i < n; ++i) {
        double v;
        std::memcpy(&v, src + 8 * i, sizeof(v));
        out[i] = static_cast<float>(v);
      }
      return;
    default:
      FORGE_FAIL("{}: tensor '{}' has dtype {}; forge loads weights from F32, BF16, F16 or F64", path(), entry.name,
                 safetensors_dtype_name(entry.dtype));
  }
}

}  // namespace forge
