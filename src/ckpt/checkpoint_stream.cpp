// Streaming shard files in and out through a bounded host buffer: NOTE [Streaming
// checkpoints] in ckpt/checkpoint_stream.h.
#include "ckpt/checkpoint_stream.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <map>

#include "ckpt/checkpoint_crc32.h"
#include "ckpt/file_reader.h"
#include "core/bf16.h"
#include "core/durable_file.h"
#include "core/error.h"

namespace forge {
namespace {

static_assert(std::endian::native == std::endian::little, "shard files are little-endian fp32");

constexpr int64_t kFloatBytes = sizeof(float);

std::string shard_file(const std::string& dir, int rank) { return fmt::format("{}/rank-{}.bin", dir, rank); }

// The fp32 elements each half of a buffer of `bytes` holds (at least one).
int64_t half_buffer_elements(size_t bytes) {
  return std::max<int64_t>(static_cast<int64_t>(bytes / 2) / kFloatBytes, 1);
}

Device device_for_copies() { return cuda_available() ? Device::CUDA : Device::CPU; }

// bf16 values at the start of `data` widened in place to fp32, last first (an fp32 element
// i lands at bytes [4i, 4i + 4), past every bf16 element not yet read).
void widen_bf16_in_place(float* data, int64_t count) {
  auto* bytes = reinterpret_cast<unsigned char*>(data);
  for (int64_t i = count - 1; i >= 0; --i) {
    BFloat16 narrow;
    std::memcpy(&narrow.bits, bytes + 2 * i, 2);
    const float value = to_float(narrow);
    std::memcpy(bytes + 4 * i, &value, 4);
  }
}

// fp32 values narrowed in place to bf16 at the start of `data`, first first.
void narrow_to_bf16_in_place(float* data, int64_t count) {
  auto* bytes = reinterpret_cast<unsigned char*>(data);
  for (int64_t i = 0; i < count; ++i) {
    float value;
    std::memcpy(&value, bytes + 4 * i, 4);
    const BFloat16 narrow = to_bf16(value);
    std::memcpy(bytes + 2 * i, &narrow.bits, 2);
  }
}

void check_segment(const FlatSegment& segment, const char* what) {
  FORGE_CHECK(segment.data.dtype() == DType::F32 || segment.data.dtype() == DType::BF16,
              "checkpoint {}: a {} tensor (fp32 or bf16 expected)", what, dtype_name(segment.data.dtype()));
  FORGE_CHECK(segment.flat_offset >= 0, "checkpoint {}: flat offset {}", what, segment.flat_offset);
}

void pwrite_all(int fd, const std::string& path, const void* data, size_t size, int64_t offset) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    const ssize_t n = ::pwrite(fd, p, size, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) FORGE_FAIL("cannot write checkpoint shard file '{}' at byte {}: {}", path, offset, std::strerror(errno));
    p += n;
    size -= static_cast<size_t>(n);
    offset += n;
  }
}

// Elements [in_chunk, in_chunk + count) of a staged chunk go to [to, to + count) of the
// destination.
struct ChunkRun {
  int64_t in_chunk = 0, to = 0, count = 0;
};

// Copies a staged chunk's runs into the destination (any device, fp32 or bf16). A host
// fp32 destination takes each run as it is. Otherwise the runs that follow each other in
// the destination are first moved together in the chunk, in place (in chunk order each
// run lies at or after the end of the runs joined before it, so nothing is overwritten
// before it was moved), narrowed to bf16 if need be, and copied as one; the copies run on
// the stream and are waited for before the chunk is read over.
class ChunkScatter {
 public:
  ChunkScatter(const Tensor& out, DeviceStream& stream)
      : out_(out),
        stream_(stream),
        element_bytes_(dtype_size(out.dtype())),
        direct_(out.device() == Device::CPU && out.dtype() == DType::F32) {}

  void copy(float* chunk, std::vector<ChunkRun>& runs) {
    std::sort(runs.begin(), runs.end(), [](const ChunkRun& a, const ChunkRun& b) { return a.in_chunk < b.in_chunk; });
    float* joined = nullptr;
    int64_t to = 0, count = 0;
    bool issued = false;
    auto issue = [&] {
      if (count == 0) return;
      if (out_.dtype() == DType::BF16) narrow_to_bf16_in_place(joined, count);
      copy_bytes_on(static_cast<char*>(out_.raw()) + to * static_cast<int64_t>(element_bytes_), out_.device(), joined,
                    Device::CPU, static_cast<size_t>(count) * element_bytes_, stream_.get());
      issued = true;
      count = 0;
    };
    for (const ChunkRun& run : runs) {
      copied_ += run.count;
      float* src = chunk + run.in_chunk;
      if (direct_) {
        std::memcpy(static_cast<float*>(out_.raw()) + run.to, src, static_cast<size_t>(run.count) * kFloatBytes);
        continue;
      }
      if (count > 0 && run.to == to + count) {
        if (src != joined + count) std::memmove(joined + count, src, static_cast<size_t>(run.count) * kFloatBytes);
        count += run.count;
        continue;
      }
      issue();
      joined = src;
      to = run.to;
      count = run.count;
    }
    issue();
    if (issued) stream_.synchronize();
  }
  int64_t copied() const { return copied_; }

 private:
  const Tensor& out_;
  DeviceStream& stream_;
  size_t element_bytes_;
  bool direct_;
  int64_t copied_ = 0;
};

}  // namespace

void create_checkpoint_shard_files(const std::string& temporary_dir, const std::vector<int64_t>& file_numel) {
  for (size_t r = 0; r < file_numel.size(); ++r) {
    const std::string path = shard_file(temporary_dir, static_cast<int>(r));
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) FORGE_FAIL("cannot create checkpoint shard file '{}': {}", path, std::strerror(errno));
    const int64_t bytes = 3 * file_numel[r] * kFloatBytes;
    const int rc = ::ftruncate(fd, static_cast<off_t>(bytes));
    const int saved_errno = errno;
    ::close(fd);
    if (rc != 0)
      FORGE_FAIL("cannot size checkpoint shard file '{}' to {} bytes: {}", path, bytes, std::strerror(saved_errno));
  }
}

void create_checkpoint_shard_files(const std::string& temporary_dir, const std::vector<ShardRange>& ranges) {
  std::vector<int64_t> file_numel;
  for (const ShardRange& range : ranges) file_numel.push_back(range.size());
  create_checkpoint_shard_files(temporary_dir, file_numel);
}

std::vector<std::vector<uint32_t>> combine_piece_crcs(const ModelConfig& model, const std::vector<ShardRange>& ranges,
                                                      std::vector<PieceCrc> parts) {
  return combine_piece_crcs(parameter_specs(model), ranges, std::move(parts));
}

std::vector<std::vector<uint32_t>> combine_piece_crcs(const std::vector<ParamSpec>& specs,
                                                      const std::vector<ShardRange>& ranges, std::vector<PieceCrc> parts) {
  const std::vector<PieceLayout> pieces = checkpoint_pieces(specs, ranges);
  const std::vector<uint32_t> crcs = combine_piece_crcs(pieces, std::move(parts));
  std::vector<std::vector<uint32_t>> by_rank(ranges.size());
  for (size_t i = 0; i < pieces.size(); ++i) by_rank[static_cast<size_t>(pieces[i].rank)].push_back(crcs[i]);
  return by_rank;
}

std::vector<uint32_t> combine_piece_crcs(const std::vector<PieceLayout>& pieces, std::vector<PieceCrc> parts) {
  std::sort(parts.begin(), parts.end(), [](const PieceCrc& a, const PieceCrc& b) {
    return a.piece != b.piece ? a.piece < b.piece : a.byte_begin < b.byte_begin;
  });
  std::vector<uint32_t> crcs;
  crcs.reserve(pieces.size());
  size_t next = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int64_t length = (pieces[i].flat_end - pieces[i].flat_begin) * kFloatBytes;
    uint32_t crc = 0;
    int64_t covered = 0;
    for (; next < parts.size() && parts[next].piece == static_cast<int64_t>(i); ++next) {
      const PieceCrc& part = parts[next];
      FORGE_CHECK(part.byte_begin == covered && part.byte_length > 0,
                  "checkpoint save: piece {} (rank {}) written at bytes {} + {}, expected byte {}", i, pieces[i].rank,
                  part.byte_begin, part.byte_length, covered);
      crc = covered == 0 ? part.crc : crc32_combine(crc, part.crc, part.byte_length);
      covered += part.byte_length;
    }
    FORGE_CHECK(covered == length, "checkpoint save: {} of the {} bytes of piece {} (rank {}) were written", covered,
                length, i, pieces[i].rank);
    crcs.push_back(crc);
  }
  FORGE_CHECK(next == parts.size(), "checkpoint save: {} CRCs for pieces that do not exist", parts.size() - next);
  return crcs;
}

std::vector<uint32_t> encode_piece_crcs(const std::vector<PieceCrc>& parts) {
  std::vector<uint32_t> words;
  words.reserve(parts.size() * kPieceCrcWords);
  for (const PieceCrc& p : parts) {
    for (int64_t v : {p.piece, p.byte_begin, p.byte_length}) {
      const auto u = static_cast<uint64_t>(v);
      words.push_back(static_cast<uint32_t>(u));
      words.push_back(static_cast<uint32_t>(u >> 32));
    }
    words.push_back(p.crc);
  }
  return words;
}

std::vector<PieceCrc> decode_piece_crcs(const uint32_t* words, size_t count) {
  std::vector<PieceCrc> parts(count);
  for (size_t i = 0; i < count; ++i) {
    const uint32_t* w = words + i * kPieceCrcWords;
    auto wide = [&](int k) { return static_cast<int64_t>(w[2 * k] | (static_cast<uint64_t>(w[2 * k + 1]) << 32)); };
    parts[i] = {wide(0), wide(1), wide(2), w[6]};
  }
  return parts;
}

// ---------------------------------------------------------------------------------------
// ShardFileWriter

ShardFileWriter::ShardFileWriter(std::string temporary_dir, const ModelConfig& model, std::vector<ShardRange> ranges,
                                 size_t buffer_bytes)
    : ShardFileWriter(std::move(temporary_dir), parameter_specs(model), std::move(ranges), buffer_bytes) {}

ShardFileWriter::ShardFileWriter(std::string temporary_dir, const std::vector<ParamSpec>& specs,
                                 std::vector<ShardRange> ranges, size_t buffer_bytes)
    : ShardFileWriter(std::move(temporary_dir), checkpoint_layout(specs, ranges), 0, buffer_bytes) {}

ShardFileWriter::ShardFileWriter(std::string temporary_dir, const CheckpointLayout& layout, int tensor_parallel_rank,
                                 size_t buffer_bytes)
    : dir_(std::move(temporary_dir)),
      pieces_(layout.pieces),
      pieces_by_state_(3),
      buffer_(static_cast<size_t>(2 * half_buffer_elements(buffer_bytes) * kFloatBytes)),
      chunk_elements_(half_buffer_elements(buffer_bytes)),
      stream_(device_for_copies()),
      fds_(static_cast<size_t>(layout.files()), -1) {
  FORGE_CHECK(tensor_parallel_rank >= 0 && tensor_parallel_rank < layout.tensor_parallel,
              "checkpoint writer of tensor-parallel rank {} of {}", tensor_parallel_rank, layout.tensor_parallel);
  // This rank's files hold pieces of its own index space only.
  for (size_t i = 0; i < pieces_.size(); ++i)
    if (pieces_[i].rank % layout.tensor_parallel == tensor_parallel_rank)
      pieces_by_state_[static_cast<size_t>(pieces_[i].state)].push_back(i);
  for (std::vector<size_t>& order : pieces_by_state_)
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return pieces_[a].flat_begin < pieces_[b].flat_begin; });
  const int device = current_device_index();
  thread_ = std::thread([this, device] {
    set_current_device_index(device);
    writer_loop();
  });
}

ShardFileWriter::~ShardFileWriter() {
  {
    std::lock_guard lock(mu_);
    closing_ = true;
  }
  changed_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (int fd : fds_)
    if (fd >= 0) ::close(fd);
}

void ShardFileWriter::after(const DeviceEvent& event) { event.make_wait(stream_.get()); }

void ShardFileWriter::write(FlatState state, const FlatSegment& segment) {
  check_segment(segment, "save");
  const Tensor& data = segment.data;
  const size_t element_bytes = dtype_size(data.dtype());
  for (int64_t k = 0; k < data.numel(); k += chunk_elements_) {
    const int64_t count = std::min(chunk_elements_, data.numel() - k);
    std::unique_lock lock(mu_);
    Chunk& chunk = chunks_[next_fill_];
    changed_.wait(lock, [&] { return !chunk.full || error_; });
    if (error_) std::rethrow_exception(error_);
    lock.unlock();
    float* half = static_cast<float*>(buffer_.data()) + next_fill_ * chunk_elements_;
    copy_bytes_on(half, Device::CPU, static_cast<const char*>(data.raw()) + k * element_bytes, data.device(),
                  static_cast<size_t>(count) * element_bytes, stream_.get());
    stream_.synchronize();
    lock.lock();
    chunk = {state, segment.flat_offset + k, count, data.dtype(), true};
    next_fill_ ^= 1;
    lock.unlock();
    changed_.notify_all();
  }
}

void ShardFileWriter::writer_loop() {
  std::unique_lock lock(mu_);
  for (;;) {
    Chunk& chunk = chunks_[next_store_];
    changed_.wait(lock, [&] { return chunk.full || closing_; });
    if (!chunk.full) return;  // closing, and every chunk is stored
    const Chunk job = chunk;
    float* data = static_cast<float*>(buffer_.data()) + next_store_ * chunk_elements_;
    lock.unlock();
    std::exception_ptr failure;
    if (!error_) {
      try {
        store(job, data);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    lock.lock();
    if (failure) error_ = failure;
    chunk.full = false;
    next_store_ ^= 1;
    changed_.notify_all();
  }
}

int ShardFileWriter::file(int rank) {
  int& fd = fds_[static_cast<size_t>(rank)];
  if (fd >= 0) return fd;
  const std::string path = shard_file(dir_, rank);
  fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) FORGE_FAIL("cannot open checkpoint shard file '{}' for writing: {}", path, std::strerror(errno));
  return fd;
}

// Writes chunk's elements (fp32 in `data` once widened) into the pieces they belong to.
void ShardFileWriter::store(const Chunk& chunk, float* data) {
  if (chunk.dtype == DType::BF16) widen_bf16_in_place(data, chunk.count);
  const std::vector<size_t>& order = pieces_by_state_[static_cast<size_t>(chunk.state)];
  const int64_t begin = chunk.flat_begin, end = begin + chunk.count;
  // The first piece that ends after `begin`.
  auto it = std::partition_point(order.begin(), order.end(), [&](size_t i) { return pieces_[i].flat_end <= begin; });
  int64_t done = begin;
  for (; it != order.end() && done < end; ++it) {
    const PieceLayout& piece = pieces_[*it];
    FORGE_CHECK(piece.flat_begin <= done, "checkpoint save: flat element {} of {} lies in no piece", done,
                flat_state_name(chunk.state));
    const int64_t stop = std::min(end, piece.flat_end);
    const float* src = data + (done - begin);
    const size_t bytes = static_cast<size_t>(stop - done) * kFloatBytes;
    const int64_t in_piece = (done - piece.flat_begin) * kFloatBytes;
    pwrite_all(file(piece.rank), shard_file(dir_, piece.rank), src, bytes, piece.byte_offset + in_piece);
    const auto index = static_cast<int64_t>(*it);
    if (!crcs_.empty() && crcs_.back().piece == index && crcs_.back().byte_begin + crcs_.back().byte_length == in_piece) {
      crcs_.back().crc = crc32(src, bytes, crcs_.back().crc);
      crcs_.back().byte_length += static_cast<int64_t>(bytes);
    } else {
      crcs_.push_back({index, in_piece, static_cast<int64_t>(bytes), crc32(src, bytes)});
    }
    done = stop;
  }
  FORGE_CHECK(done == end, "checkpoint save: flat elements [{}, {}) of {} lie beyond the model's {}", done, end,
              flat_state_name(chunk.state), pieces_.empty() ? 0 : pieces_.back().flat_end);
}

std::vector<PieceCrc> ShardFileWriter::finish() {
  {
    std::unique_lock lock(mu_);
    changed_.wait(lock, [&] { return (!chunks_[0].full && !chunks_[1].full) || error_; });
    closing_ = true;
  }
  changed_.notify_all();
  thread_.join();
  if (error_) std::rethrow_exception(error_);
  for (size_t r = 0; r < fds_.size(); ++r) {
    if (fds_[r] < 0) continue;
    const int rc = ::fsync(fds_[r]);
    const int saved_errno = errno;
    ::close(fds_[r]);
    fds_[r] = -1;
    if (rc != 0)
      FORGE_FAIL("cannot flush checkpoint shard file '{}' to disk: {}", shard_file(dir_, static_cast<int>(r)),
                 std::strerror(saved_errno));
  }
  return std::move(crcs_);
}

// ---------------------------------------------------------------------------------------
// ShardFileReader

ShardFileReader::ShardFileReader(const Checkpoint& checkpoint, size_t buffer_bytes)
    : checkpoint_(checkpoint),
      buffer_(static_cast<size_t>(half_buffer_elements(buffer_bytes) * 2 * kFloatBytes)),
      stream_(device_for_copies()),
      readers_(static_cast<size_t>(checkpoint.metadata.files())) {
  for (const TensorRecord& rec : checkpoint.metadata.tensors) records_[static_cast<size_t>(rec.state)].push_back(&rec);
  for (auto& records : records_)
    std::stable_sort(records.begin(), records.end(),
                     [](const TensorRecord* a, const TensorRecord* b) { return a->flat_offset < b->flat_offset; });
}

ShardFileReader::~ShardFileReader() = default;

void ShardFileReader::read(FlatState state, const FlatSegment& segment) {
  check_segment(segment, "load");
  const int64_t begin = segment.flat_offset, end = begin + segment.data.numel();
  FORGE_CHECK(end <= checkpoint_.metadata.flat_numel, "range [{}, {}) of {}", begin, end,
              checkpoint_.metadata.flat_numel);
  // The range's part of each tensor, consecutive flat elements of it.
  std::vector<BandRange> image;
  int64_t covered = 0;
  for (const TensorRecord* rec : records_[static_cast<size_t>(state)]) {
    const int64_t numel = shape_numel(rec->shape), b = std::max(begin, rec->flat_offset);
    const int64_t e = std::min(end, rec->flat_offset + numel);
    if (b >= e) continue;
    const int64_t columns = band_columns(rec->shape);
    image.push_back({rec->flat_offset, columns, 0, columns, b - rec->flat_offset, e - rec->flat_offset});
    covered += e - b;
  }
  if (covered != end - begin)
    FORGE_FAIL("checkpoint '{}' does not cover flat elements [{}, {}) of {}", checkpoint_.dir, begin, end,
               flat_state_name(state));
  read(state, segment.data, image);
}

const TensorRecord* ShardFileReader::record_at(FlatState state, int64_t flat_offset) const {
  const auto& records = records_[static_cast<size_t>(state)];
  const auto it = std::lower_bound(records.begin(), records.end(), flat_offset,
                                   [](const TensorRecord* rec, int64_t at) { return rec->flat_offset < at; });
  return it != records.end() && (*it)->flat_offset == flat_offset ? *it : nullptr;
}

void ShardFileReader::read(FlatState state, const Tensor& out, const std::vector<BandRange>& image) {
  check_segment({0, out}, "load");
  std::vector<int64_t> at;  // where each range's elements go in `out`
  int64_t total = 0;
  for (const BandRange& range : image) {
    at.push_back(total);
    total += range.size();
  }
  FORGE_CHECK(total == out.numel(), "checkpoint load: {} elements named for a tensor of {}", total, out.numel());
  // What the device did to `out` before (on any stream) is done before the copies start.
  if (out.device() != Device::CPU) device_synchronize();
  // The pieces that hold any of the named elements, each read once for every range it serves.
  struct Job {
    const TensorRecord* rec;
    const TensorPiece* piece;
    BandRange band;
    std::vector<size_t> ranges;
  };
  std::vector<Job> jobs;
  std::map<const TensorPiece*, size_t> job_of;
  for (size_t i = 0; i < image.size(); ++i) {
    const BandRange& range = image[i];
    if (range.size() == 0) continue;
    const TensorRecord* rec = record_at(state, range.flat_offset);
    if (rec == nullptr)
      FORGE_FAIL("checkpoint '{}' holds no tensor at flat element {} ({})", checkpoint_.dir, range.flat_offset,
                 flat_state_name(state));
    const int64_t columns = band_columns(rec->shape);
    FORGE_CHECK(range.columns == columns && range.band_begin >= 0 && range.band_begin + range.band_width <= columns &&
                    range.begin >= 0 && range.end <= shape_numel(rec->shape) / columns * range.band_width,
                "checkpoint load: elements [{}, {}) of columns [{}, +{}) of tensor '{}' {}", range.begin, range.end,
                range.band_begin, range.band_width, rec->name, shape_str(rec->shape));
    for (const TensorPiece& p : rec->pieces) {
      const BandRange band = piece_band(*rec, p);
      if (!bands_intersect(band, range)) continue;
      const auto [it, added] = job_of.emplace(&p, jobs.size());
      if (added) jobs.push_back({rec, &p, band, {}});
      jobs[it->second].ranges.push_back(i);
    }
  }
  const int64_t chunk_elements = static_cast<int64_t>(buffer_.size()) / kFloatBytes;
  float* staging = static_cast<float*>(buffer_.data());
  ChunkScatter scatter(out, stream_);
  std::vector<ChunkRun> runs;
  for (const Job& job : jobs) {
    const TensorPiece& p = *job.piece;
    const std::string path = shard_file(checkpoint_.dir, p.rank);
    auto& reader = readers_[static_cast<size_t>(p.rank)];
    if (!reader) reader = std::make_unique<FileReader>(path);
    const std::string what = fmt::format("tensor '{}' ({})", job.rec->name, flat_state_name(job.rec->state));
    // The whole piece is read for its CRC-32; what the ranges share with it is kept.
    uint32_t crc = 0;
    for (int64_t k = 0; k < job.band.size(); k += chunk_elements) {
      const int64_t count = std::min(chunk_elements, job.band.size() - k);
      if (!reader->read_at(p.byte_offset + k * kFloatBytes, staging, static_cast<size_t>(count) * kFloatBytes))
        FORGE_FAIL("shard file '{}' ends inside {} (bytes {} to {})", path, what, p.byte_offset,
                   p.byte_offset + p.byte_length);
      crc = crc32(staging, static_cast<size_t>(count) * kFloatBytes, crc);
      BandRange chunk = job.band;
      chunk.begin += k;
      chunk.end = chunk.begin + count;
      runs.clear();
      for (size_t i : job.ranges)
        for_each_common_run(chunk, image[i], [&](int64_t in_chunk, int64_t in_range, int64_t n) {
          runs.push_back({in_chunk, at[i] + in_range, n});
          return true;
        });
      scatter.copy(staging, runs);
    }
    if (crc != p.crc32)
      FORGE_FAIL("shard file '{}' is damaged: {} (bytes {} to {}) has CRC-32 {:08x}, the metadata recorded {:08x}",
                 path, what, p.byte_offset, p.byte_offset + p.byte_length, crc, p.crc32);
  }
  if (scatter.copied() != total)
    FORGE_FAIL("checkpoint '{}' does not cover the {} elements asked for ({} found) of {}", checkpoint_.dir, total,
               scatter.copied(), flat_state_name(state));
}

}  // namespace forge
