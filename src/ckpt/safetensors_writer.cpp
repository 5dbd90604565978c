// The safetensors writer. The header is built first (offsets follow from the shapes), so
// the tensors can then be streamed to disk in bounded chunks: a multi-gigabyte shard
// never needs a second copy in memory. bf16 and fp16 output is converted chunk by chunk. The file
// is an AtomicFile: readers see the old file or the complete new one.
#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "ckpt/half_float.h"
#include "ckpt/safetensors.h"
#include "core/durable_file.h"

namespace forge {
namespace {

SafetensorsDType stored_as(const SafetensorsTensorRef& t, SafetensorsDType file_dtype) {
  const SafetensorsDType dtype = t.stored.value_or(file_dtype);
  FORGE_CHECK(dtype == SafetensorsDType::F32 || dtype == SafetensorsDType::BF16 || dtype == SafetensorsDType::F16,
              "safetensors writer stores F32, BF16 or F16, not {}", safetensors_dtype_name(dtype));
  return dtype;
}

}  // namespace

std::string safetensors_header(const std::vector<SafetensorsTensorRef>& tensors, SafetensorsDType stored,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    FORGE_CHECK(t.name != "__metadata__" && names.insert(t.name).second, "tensor name '{}' repeated or reserved", t.name);
    FORGE_CHECK(t.row_order.empty() || (!t.shape.empty() && static_cast<int64_t>(t.row_order.size()) == t.shape[0]),
                "tensor '{}': a row order of {} rows for shape {}", t.name, t.row_order.size(), shape_str(t.shape));
    for (const int64_t row : t.row_order)
      FORGE_CHECK(0 <= row && row < t.shape[0], "tensor '{}': row {} of the row order is outside its {} rows", t.name,
                  row, t.shape[0]);
    const SafetensorsDType dtype = stored_as(t, stored);
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(t.shape)) * safetensors_dtype_size(dtype);
    header[t.name] = {{"dtype", safetensors_dtype_name(dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  return text;
}

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensorRef>& tensors,
                       SafetensorsDType stored, const std::map<std::string, std::string>& metadata) {
  FORGE_CHECK(stored == SafetensorsDType::F32 || stored == SafetensorsDType::BF16 || stored == SafetensorsDType::F16,
              "safetensors writer stores F32, BF16 or F16, not {}", safetensors_dtype_name(stored));
  const std::string header = safetensors_header(tensors, stored, metadata);
  const uint64_t header_bytes = header.size();

  AtomicFile out(path, {.sync = false});  // NOTE [Durable files]
  out.write(&header_bytes, sizeof(header_bytes));
  out.write(header.data(), header.size());
  constexpr int64_t kChunk = 1 << 16;
  std::vector<uint16_t> converted(kChunk);
  // Values [0, n) of `data`, converted in chunks.
  auto write_values = [&](const float* data, int64_t n, SafetensorsDType dtype) {
    if (dtype == SafetensorsDType::F32) return out.write(data, static_cast<size_t>(n) * sizeof(float));
    uint16_t (*narrow)(float) = dtype == SafetensorsDType::BF16 ? float_to_bf16 : float_to_f16;
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t count = std::min(kChunk, n - start);
      for (int64_t i = 0; i < count; ++i) converted[i] = narrow(data[start + i]);
      out.write(converted.data(), static_cast<size_t>(count) * sizeof(uint16_t));
    }
  };
  for (const auto& t : tensors) {
    const int64_t n = shape_numel(t.shape);
    const SafetensorsDType dtype = stored_as(t, stored);
    if (t.row_order.empty()) {
      write_values(t.data, n, dtype);
      continue;
    }
    const int64_t row = n / t.shape[0];
    for (const int64_t source : t.row_order) write_values(t.data + source * row, row, dtype);
  }
  out.commit();
}

}  // namespace forge
