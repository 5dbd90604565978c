// Streaming decompression for InputStream; see input_stream.h. Each decoder pulls
// compressed bytes from the file in 256 KiB reads (by default) and fills the caller's buffer, flushing
// what the library still holds after the file's end before declaring the data complete.
#include "data/input_stream.h"

#include <zlib.h>
#include <unistd.h>
#include <zstd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "core/input_file.h"

namespace forge {

namespace {

bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

class InputStream::Decoder {
 public:
  explicit Decoder(InputStream& source) : source_(source) {}
  virtual ~Decoder() = default;
  virtual size_t read(char* out, size_t capacity) = 0;

 protected:
  // Reads up to `capacity` bytes of the file itself; 0 at its end.
  size_t pull(char* out, size_t capacity) { return source_.read_file(out, capacity); }
  // Reads the next chunk of the file into buffer_; returns its size (0 at the end).
  size_t refill() {
    if (!buffer_) buffer_ = std::make_unique_for_overwrite<char[]>(source_.file_chunk_);
    return pull(buffer_.get(), source_.file_chunk_);
  }

  InputStream& source_;
  std::unique_ptr<char[]> buffer_;  // file_chunk_ bytes, not zeroed, from the first refill
};

namespace {

class GzipDecoder : public InputStream::Decoder {
 public:
  explicit GzipDecoder(InputStream& source) : Decoder(source) {
    if (inflateInit2(&stream_, 16 + MAX_WBITS) != Z_OK) FORGE_FAIL("{}: cannot start the gzip decoder", source.path());
  }
  ~GzipDecoder() override { inflateEnd(&stream_); }

  size_t read(char* out, size_t capacity) override {
    stream_.next_out = reinterpret_cast<Bytef*>(out);
    stream_.avail_out = static_cast<uInt>(capacity);
    while (stream_.avail_out == capacity) {
      if (stream_.avail_in == 0 && !at_file_end_) {
        const size_t n = refill();
        at_file_end_ = n == 0;
        stream_.next_in = reinterpret_cast<Bytef*>(buffer_.get());
        stream_.avail_in = static_cast<uInt>(n);
      }
      if (between_members_) {
        if (stream_.avail_in == 0) return 0;
        inflateReset(&stream_);
        between_members_ = false;
      }
      const int rc = inflate(&stream_, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        between_members_ = true;
      } else if (rc == Z_BUF_ERROR && at_file_end_ && stream_.avail_in == 0 && stream_.avail_out == capacity) {
        FORGE_FAIL("{}: truncated gzip data: the file ends inside a compressed member", source_.path());
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        FORGE_FAIL("{}: corrupt gzip data near byte offset {}: {}", source_.path(),
                   source_.file_bytes_read() - stream_.avail_in, stream_.msg ? stream_.msg : "inflate failed");
      }
    }
    return capacity - stream_.avail_out;
  }

 private:
  z_stream stream_{};
  bool at_file_end_ = false;
  bool between_members_ = true;
};

class ZstdDecoder : public InputStream::Decoder {
 public:
  explicit ZstdDecoder(InputStream& source) : Decoder(source), stream_(ZSTD_createDStream()) {
    if (!stream_) FORGE_FAIL("{}: cannot start the zstd decoder", source.path());
  }
  ~ZstdDecoder() override { ZSTD_freeDStream(stream_); }

  size_t read(char* out, size_t capacity) override {
    ZSTD_outBuffer output{out, capacity, 0};
    while (output.pos == 0) {
      if (input_.pos == input_.size && !at_file_end_) {
        const size_t n = refill();
        at_file_end_ = n == 0;
        input_ = {buffer_.get(), n, 0};
        if (n > 0) started_ = true;
      }
      if (!started_) return 0;
      const size_t consumed_before = input_.pos;
      const size_t hint = ZSTD_decompressStream(stream_, &output, &input_);
      if (ZSTD_isError(hint))
        FORGE_FAIL("{}: corrupt zstd data near byte offset {}: {}", source_.path(),
                   source_.file_bytes_read() - (input_.size - input_.pos), ZSTD_getErrorName(hint));
      // A call that moved no data reports what the next frame would need; only a call
      // that made progress says whether the frame in flight is complete (hint 0).
      if (input_.pos != consumed_before || output.pos != 0) frame_complete_ = hint == 0;
      if (output.pos == 0 && at_file_end_ && input_.pos == input_.size) {
        if (!frame_complete_) FORGE_FAIL("{}: truncated zstd data: the file ends inside a frame", source_.path());
        return 0;
      }
    }
    return output.pos;
  }

 private:
  ZSTD_DStream* stream_;
  ZSTD_inBuffer input_{nullptr, 0, 0};
  bool at_file_end_ = false;
  bool started_ = false;
  bool frame_complete_ = true;
};

class PlainDecoder : public InputStream::Decoder {
 public:
  using Decoder::Decoder;
  size_t read(char* out, size_t capacity) override { return pull(out, capacity); }
};

}  // namespace

Compression compression_of(const std::string& path) {
  if (ends_with(path, ".gz")) return Compression::Gzip;
  if (ends_with(path, ".zst")) return Compression::Zstd;
  return Compression::None;
}

std::string without_compression_suffix(const std::string& path) {
  switch (compression_of(path)) {
    case Compression::Gzip: return path.substr(0, path.size() - 3);
    case Compression::Zstd: return path.substr(0, path.size() - 4);
    case Compression::None: break;
  }
  return path;
}

InputStream::InputStream(std::string path, size_t file_chunk) : path_(std::move(path)), file_chunk_(file_chunk) {
  FORGE_CHECK(file_chunk_ > 0, "file chunk of 0 bytes for {}", path_);
  const int fd = open_regular_file(path_, "the input file");  // NOTE [User files must be regular files]
  file_ = ::fdopen(fd, "rb");
  if (!file_) {
    const int error = errno;
    ::close(fd);
    FORGE_FAIL("{}: cannot open for reading: {}", path_, std::strerror(error));
  }
  switch (compression_of(path_)) {
    case Compression::Gzip: decoder_ = std::make_unique<GzipDecoder>(*this); break;
    case Compression::Zstd: decoder_ = std::make_unique<ZstdDecoder>(*this); break;
    case Compression::None: decoder_ = std::make_unique<PlainDecoder>(*this); break;
  }
}

InputStream::~InputStream() {
  decoder_.reset();
  if (file_) std::fclose(file_);
}

size_t InputStream::read(char* out, size_t capacity) {
  FORGE_CHECK(capacity > 0, "read of 0 bytes from {}", path_);
  return decoder_->read(out, capacity);
}

size_t InputStream::read_file(char* out, size_t capacity) {
  const size_t n = std::fread(out, 1, capacity, file_);
  if (n < capacity && std::ferror(file_)) FORGE_FAIL("{}: read failed: {}", path_, std::strerror(errno));
  file_bytes_read_ += n;
  return n;
}

}  // namespace forge
