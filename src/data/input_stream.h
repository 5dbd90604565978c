// InputStream: the bytes of one input file, decompressed on the fly when its name says it
// is compressed. dataset preparation reads corpora that are usually shipped compressed
// (C4 and The Pile as .json.gz or .jsonl.zst), often larger than memory, so nothing is
// ever decompressed to disk or held whole: read() fills a caller's buffer from a
// streaming zlib or libzstd decoder.
//
//   *.gz   gzip (zlib, concatenated members included, as `gzip -d` reads them)
//   *.zst  Zstandard (every frame of the file, as `zstd -d` reads them)
//   other  read as is
//
// A corrupt or truncated compressed file fails with the path and what is wrong. The
// compressed bytes consumed so far are counted, for progress against the file sizes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>

namespace forge {

enum class Compression { None, Gzip, Zstd };

// By the file name's last suffix: .gz, .zst, anything else is uncompressed.
Compression compression_of(const std::string& path);

// The file name without a compression suffix ("a.jsonl.zst" -> "a.jsonl").
std::string without_compression_suffix(const std::string& path);

class InputStream {
 public:
  // The compressed bytes a decoder reads from the file at a time, by default.
  static constexpr size_t kDefaultFileChunk = size_t{1} << 18;

  // Opens the file; fails naming it when it cannot be read. A compressed file is read
  // `file_chunk` bytes at a time (allocated on the first read; a plain file needs none).
  explicit InputStream(std::string path, size_t file_chunk = kDefaultFileChunk);
  ~InputStream();
  InputStream(const InputStream&) = delete;
  InputStream& operator=(const InputStream&) = delete;

  // Reads up to `capacity` decompressed bytes into `out`; 0 only at the end of the data.
  size_t read(char* out, size_t capacity);
  // Bytes of the file itself (compressed) consumed so far.
  uint64_t file_bytes_read() const { return file_bytes_read_; }
  const std::string& path() const { return path_; }

  class Decoder;

 private:
  size_t read_file(char* out, size_t capacity);

  std::string path_;
  std::FILE* file_ = nullptr;
  size_t file_chunk_;
  uint64_t file_bytes_read_ = 0;
  std::unique_ptr<Decoder> decoder_;
};

}  // namespace forge
