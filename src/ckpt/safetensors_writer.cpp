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

std::string header_text(const std::vector<SafetensorsTensorRef>& tensors, SafetensorsDType stored,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    FORGE_CHECK(t.name != "__metadata__" && names.insert(t.name).second, "tensor name '{}' repeated or reserved", t.name);
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(t.shape)) * safetensors_dtype_size(stored);
    header[t.name] = {{"dtype", safetensors_dtype_name(stored)}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  return text;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<SafetensorsTensorRef>& tensors,
                       SafetensorsDType stored, const std::map<std::string, std::string>& metadata) {
  FORGE_CHECK(stored == SafetensorsDType::F32 || stored == SafetensorsDType::BF16 || stored == SafetensorsDType::F16,
              "safetensors writer stores F32, BF16 or F16, not {}", safetensors_dtype_name(stored));
  uint16_t (*narrow)(float) = stored == SafetensorsDType::BF16 ? float_to_bf16 : float_to_f16;
  const std::string header = header_text(tensors, stored, metadata);
  const uint64_t header_bytes = header.size();

  AtomicFile out(path, {.sync = false});  // NOTE [Durable files]
  out.write(&header_bytes, sizeof(header_bytes));
  out.write(header.data(), header.size());
  constexpr int64_t kChunk = 1 << 16;
  std::vector<uint16_t> converted(kChunk);
  for (const auto& t : tensors) {
    const int64_t n = shape_numel(t.shape);
    if (stored == SafetensorsDType::F32) {
      out.write(t.data, static_cast<size_t>(n) * sizeof(float));
      continue;
    }
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t count = std::min(kChunk, n - start);
      for (int64_t i = 0; i < count; ++i) converted[i] = narrow(t.data[start + i]);
      out.write(converted.data(), static_cast<size_t>(count) * sizeof(uint16_t));
    }
  }
  out.commit();
}

}  // namespace forge
