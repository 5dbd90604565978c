// FileReader; see ckpt/file_reader.h.
#include "ckpt/file_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "core/input_file.h"

namespace forge {
namespace {

std::string system_reason() { return std::strerror(errno); }

}  // namespace

FileReader::FileReader(std::string path) : path_(std::move(path)) {
  fd_ = open_regular_file(path_, "checkpoint file");  // NOTE [User files must be regular files]
  struct stat st {};
  if (::fstat(fd_, &st) != 0) FORGE_FAIL("cannot stat '{}': {}", path_, system_reason());
  size_ = st.st_size;
}

FileReader::~FileReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool FileReader::read_at(int64_t offset, void* out, size_t size) const {
  auto* p = static_cast<char*>(out);
  while (size > 0) {
    ssize_t n = ::pread(fd_, p, size, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) FORGE_FAIL("failed reading '{}': {}", path_, system_reason());
    if (n == 0) return false;
    p += n;
    offset += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace forge
