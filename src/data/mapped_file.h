// A read-only memory map of a whole file (POSIX mmap), released on destruction. The
// indexed dataset reads its .bin and .idx through this so that multi-gigabyte corpora
// cost page cache, not heap. An empty file maps to size() == 0 and a null data().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace forge {

class MappedFile {
 public:
  // Throws a forge::Error naming the path when the file cannot be opened or mapped.
  explicit MappedFile(std::string path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace forge
