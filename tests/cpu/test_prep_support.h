// Test doubles and file helpers for the dataset-preparation tests: a byte tokenizer (one
// id per byte, so expected ids are computed from the text by hand) and writers of plain,
// gzip and zstd files made with zlib and libzstd themselves.
#pragma once

#include <zlib.h>
#include <zstd.h>

#include <atomic>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/tokenizer.h"
#include "file_testing.h"

namespace forge::test {

// Byte b becomes id b + offset; EOS is id 1 when present. With fail_on set, encoding a
// text that contains it throws (a tokenizer failure in the middle of a run).
class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(int64_t vocab_size = 259, int32_t offset = 3, std::optional<int32_t> eos = 1)
      : vocab_size_(vocab_size), offset_(offset), eos_(eos) {}
  std::vector<int32_t> encode(std::string_view text) const override {
    if (!fail_on.empty() && text.find(fail_on) != std::string_view::npos) FORGE_FAIL("tokenizer failed");
    std::vector<int32_t> ids;
    for (unsigned char c : text) ids.push_back(static_cast<int32_t>(c) + offset_);
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    std::string text;
    for (int32_t id : ids) text.push_back(static_cast<char>(id - offset_));
    return text;
  }
  int64_t vocab_size() const override { return vocab_size_; }
  std::optional<int32_t> bos_id() const override { return std::nullopt; }
  std::optional<int32_t> eos_id() const override { return eos_; }

  std::string fail_on;

 private:
  int64_t vocab_size_;
  int32_t offset_;
  std::optional<int32_t> eos_;
};

using testing::write_file;

// gzip file of `data` as `members` concatenated gzip members.
inline void write_gzip_file(const std::string& path, const std::string& data, int members = 1) {
  gzFile file = gzopen(path.c_str(), "wb");
  const size_t part = data.size() / static_cast<size_t>(members) + 1;
  for (int m = 0; m < members; ++m) {
    const size_t begin = std::min(data.size(), part * static_cast<size_t>(m));
    const size_t end = std::min(data.size(), begin + part);
    if (m > 0) {
      gzclose(file);
      file = gzopen(path.c_str(), "ab");
    }
    gzwrite(file, data.data() + begin, static_cast<unsigned>(end - begin));
  }
  gzclose(file);
}

// zstd file of `data` as `frames` concatenated frames.
inline void write_zstd_file(const std::string& path, const std::string& data, int frames = 1) {
  std::string out;
  const size_t part = data.size() / static_cast<size_t>(frames) + 1;
  for (int f = 0; f < frames; ++f) {
    const size_t begin = std::min(data.size(), part * static_cast<size_t>(f));
    const size_t end = std::min(data.size(), begin + part);
    std::string frame(ZSTD_compressBound(end - begin), '\0');
    frame.resize(ZSTD_compress(frame.data(), frame.size(), data.data() + begin, end - begin, 3));
    out += frame;
  }
  write_file(path, out);
}

using testing::read_file;

}  // namespace forge::test
