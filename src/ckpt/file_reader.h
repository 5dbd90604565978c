// Reading byte ranges of a file by offset (pread), as checkpoint loading does for the
// pieces of each shard file. Each failure is a forge::Error naming the path and the
// system's reason.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace forge {

// Reads `size` bytes at `offset` of an open file into out; false when the file ends first.
class FileReader {
 public:
  explicit FileReader(std::string path);
  ~FileReader();
  FileReader(const FileReader&) = delete;
  FileReader& operator=(const FileReader&) = delete;

  int64_t size() const { return size_; }
  bool read_at(int64_t offset, void* out, size_t size) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

}  // namespace forge
