#include "ckpt/hf_export_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include <fmt/format.h>

#include "ckpt/half_float.h"

namespace forge {
namespace {

constexpr int64_t kConvertChunk = int64_t{1} << 16;  // elements converted to 16 bits per write

uint64_t stored_bytes(const Shape& shape, SafetensorsDType dtype) {
  return static_cast<uint64_t>(shape_numel(shape)) * safetensors_dtype_size(dtype);
}

void pwrite_all(int fd, const std::string& path, const void* data, size_t size, uint64_t offset) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      FORGE_FAIL("cannot write the Hugging Face export file '{}' at byte {}: {}", path, offset, std::strerror(errno));
    p += n;
    size -= static_cast<size_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

std::string join(const std::string& dir, const std::string& name) {
  return (std::filesystem::path(dir) / name).string();
}

}  // namespace

HfExportPlan::HfExportPlan(const ModelConfig& config, SafetensorsDType dtype, uint64_t max_shard_bytes,
                           bool interleaved_rotary)
    : specs_(parameter_specs(config)) {
  add_parts(interleaved_rotary, dtype);
  for (HfPart& part : hf_empty_parts(config)) tensors_.push_back({std::move(part), 0, dtype});
  lay_out(dtype, max_shard_bytes);
}

HfExportPlan::HfExportPlan(std::vector<ParamSpec> specs, SafetensorsDType dtype, uint64_t max_shard_bytes,
                           const std::string& stem)
    : specs_(std::move(specs)), stem_(stem) {
  FORGE_CHECK(!stem_.empty(), "an export's files need a name");
  add_parts(false, dtype);
  // By name; tensors_of_ follows the tensors to their new places.
  std::vector<size_t> order(tensors_.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return tensors_[a].part.name < tensors_[b].part.name; });
  std::vector<HfExportTensor> sorted;
  std::vector<size_t> place(order.size());
  for (size_t k = 0; k < order.size(); ++k) {
    FORGE_CHECK(k == 0 || tensors_[order[k]].part.name != sorted.back().part.name, "tensor name '{}' repeated",
                tensors_[order[k]].part.name);
    place[order[k]] = k;
    sorted.push_back(std::move(tensors_[order[k]]));
  }
  tensors_ = std::move(sorted);
  for (std::vector<size_t>& of : tensors_of_)
    for (size_t& k : of) k = place[k];
  lay_out(dtype, max_shard_bytes);
}

void HfExportPlan::add_parts(bool interleaved_rotary, SafetensorsDType dtype) {
  FORGE_CHECK(dtype == SafetensorsDType::F32 || dtype == SafetensorsDType::BF16 || dtype == SafetensorsDType::F16,
              "Hugging Face export stores F32, BF16 or F16, not {}", safetensors_dtype_name(dtype));
  tensors_of_.resize(specs_.size());
  for (size_t i = 0; i < specs_.size(); ++i) {
    numel_ += shape_numel(specs_[i].shape);
    for (HfPart& part : hf_parts(specs_[i], interleaved_rotary)) {
      HfExportTensor t;
      t.spec = i;
      t.dtype = part.keep_fp32 ? SafetensorsDType::F32 : dtype;
      t.file_row.resize(part.row_order.size());
      for (size_t r = 0; r < part.row_order.size(); ++r)
        t.file_row[static_cast<size_t>(part.row_order[r])] = static_cast<int64_t>(r);
      t.part = std::move(part);
      tensors_of_[i].push_back(tensors_.size());
      tensors_.push_back(std::move(t));
    }
  }
}

void HfExportPlan::lay_out(SafetensorsDType dtype, uint64_t max_shard_bytes) {
  FORGE_CHECK(max_shard_bytes > 0, "max_shard_bytes must be positive");
  // Consecutive runs of tensors of at most max_shard_bytes each (a larger tensor gets a
  // shard of its own), as save_pretrained splits them.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t bytes = 0;
  for (size_t k = 0; k < tensors_.size(); ++k) {
    const uint64_t size = stored_bytes(tensors_[k].part.shape, tensors_[k].dtype);
    if (!shards.back().empty() && bytes + size > max_shard_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(k);
    bytes += size;
  }
  for (size_t s = 0; s < shards.size(); ++s) {
    HfExportFile file;
    file.name = shards.size() == 1 ? stem_ + ".safetensors"
                                   : fmt::format("{}-{:05d}-of-{:05d}.safetensors", stem_, s + 1, shards.size());
    std::vector<SafetensorsTensorRef> refs;
    for (size_t k : shards[s])
      refs.push_back({tensors_[k].part.name, tensors_[k].part.shape, nullptr, {}, tensors_[k].dtype});
    file.header = safetensors_header(refs, dtype, {{"format", "pt"}});
    uint64_t offset = sizeof(uint64_t) + file.header.size();
    for (size_t k : shards[s]) {
      tensors_[k].file = s;
      tensors_[k].begin = offset;
      offset += stored_bytes(tensors_[k].part.shape, tensors_[k].dtype);
    }
    file.bytes = offset;
    files_.push_back(std::move(file));
  }
}

std::string HfExportPlan::index_json(nlohmann::json metadata) const {
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total_bytes = 0;
  for (const HfExportTensor& t : tensors_) {
    weight_map[t.part.name] = files_[t.file].name;
    total_bytes += stored_bytes(t.part.shape, t.dtype);
  }
  metadata["total_size"] = total_bytes;
  const nlohmann::json index = {{"metadata", metadata}, {"weight_map", weight_map}};
  return index.dump(2) + "\n";
}

void HfExportPlan::create_files(const std::string& dir) const {
  for (const HfExportFile& f : files_) {
    const std::string path = join(dir, f.name);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) FORGE_FAIL("cannot create the Hugging Face export file '{}': {}", path, std::strerror(errno));
    try {
      const uint64_t length = f.header.size();
      pwrite_all(fd, path, &length, sizeof(length), 0);
      pwrite_all(fd, path, f.header.data(), f.header.size(), sizeof(length));
      if (::ftruncate(fd, static_cast<off_t>(f.bytes)) != 0)
        FORGE_FAIL("cannot size the Hugging Face export file '{}' to {} bytes: {}", path, f.bytes,
                   std::strerror(errno));
    } catch (...) {
      ::close(fd);
      throw;
    }
    if (::close(fd) != 0) FORGE_FAIL("cannot write the Hugging Face export file '{}': {}", path, std::strerror(errno));
  }
}

HfExportWriter::HfExportWriter(const HfExportPlan& plan, const std::string& dir)
    : plan_(plan), fds_(plan.files().size(), -1) {
  for (const HfExportFile& f : plan.files()) paths_.push_back(join(dir, f.name));
}

HfExportWriter::~HfExportWriter() {
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

void HfExportWriter::close() {
  for (size_t f = 0; f < fds_.size(); ++f) {
    if (fds_[f] < 0) continue;
    const int fd = std::exchange(fds_[f], -1);
    if (::close(fd) != 0)
      FORGE_FAIL("cannot write the Hugging Face export file '{}': {}", paths_[f], std::strerror(errno));
  }
}

int HfExportWriter::file(size_t index) {
  if (fds_[index] >= 0) return fds_[index];
  fds_[index] = ::open(paths_[index].c_str(), O_WRONLY | O_CLOEXEC);  // made by create_files
  if (fds_[index] < 0)
    FORGE_FAIL("cannot open the Hugging Face export file '{}': {}", paths_[index], std::strerror(errno));
  return fds_[index];
}

void HfExportWriter::write(size_t spec, std::span<const float> values, int64_t begin, TensorParallelShard shard) {
  FORGE_CHECK(spec < plan_.specs().size(), "Hugging Face export: parameter {} of {}", spec, plan_.specs().size());
  const ParamSpec& full = plan_.specs()[spec];
  const int64_t count = static_cast<int64_t>(values.size()), end = begin + count;
  if (shard.size <= 1) {
    FORGE_CHECK(begin >= 0 && end <= shape_numel(full.shape), "Hugging Face export: elements [{}, {}) of '{}' {}",
                begin, end, full.name, shape_str(full.shape));
    return write_whole(spec, begin, values.data(), count);
  }
  const std::vector<ShardRun> runs = tensor_parallel_runs(full, shard);
  const int64_t shard_numel = runs.empty() ? 0 : runs.back().local_begin + runs.back().count;
  FORGE_CHECK(begin >= 0 && end <= shard_numel,
              "Hugging Face export: elements [{}, {}) of tensor-parallel rank {}'s {} "
              "of '{}'",
              begin, end, shard.rank, shard_numel, full.name);
  for (const ShardRun& run : runs) {
    const int64_t from = std::max(begin, run.local_begin), to = std::min(end, run.local_begin + run.count);
    if (from < to)
      write_whole(spec, run.full_begin + (from - run.local_begin), values.data() + (from - begin), to - from);
  }
}

// Elements [first, first + count) of the whole parameter, through its parts.
void HfExportWriter::write_whole(size_t spec, int64_t first, const float* values, int64_t count) {
  for (size_t k : plan_.tensors_of(spec)) {
    const HfExportTensor& t = plan_.tensors()[k];
    const int64_t part_numel = shape_numel(t.part.shape);
    const int64_t from = std::max(first, t.part.offset), to = std::min(first + count, t.part.offset + part_numel);
    if (from >= to) continue;
    const float* data = values + (from - first);
    const int64_t at = from - t.part.offset, n = to - from;
    if (t.file_row.empty()) {
      store(t, at, data, n);
      continue;
    }
    const int64_t row = part_numel / t.part.shape[0];
    for (int64_t e = at; e < at + n;) {
      const int64_t within = e % row, piece = std::min(row - within, at + n - e);
      store(t, t.file_row[static_cast<size_t>(e / row)] * row + within, data + (e - at), piece);
      e += piece;
    }
  }
  written_ += count;
}

void HfExportWriter::store(const HfExportTensor& t, int64_t element, const float* values, int64_t count) {
  const int fd = file(t.file);
  const std::string& path = paths_[t.file];
  const uint64_t size = safetensors_dtype_size(t.dtype);
  const uint64_t offset = t.begin + static_cast<uint64_t>(element) * size;
  if (t.dtype == SafetensorsDType::F32)
    return pwrite_all(fd, path, values, static_cast<size_t>(count) * sizeof(float), offset);
  uint16_t (*narrow)(float) = t.dtype == SafetensorsDType::BF16 ? float_to_bf16 : float_to_f16;
  converted_.resize(static_cast<size_t>(kConvertChunk));
  for (int64_t start = 0; start < count; start += kConvertChunk) {
    const int64_t n = std::min(kConvertChunk, count - start);
    for (int64_t i = 0; i < n; ++i) converted_[static_cast<size_t>(i)] = narrow(values[start + i]);
    pwrite_all(fd, path, converted_.data(), static_cast<size_t>(n) * sizeof(uint16_t),
               offset + static_cast<uint64_t>(start) * size);
  }
}

}  // namespace forge
