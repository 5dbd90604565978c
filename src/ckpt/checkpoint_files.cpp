#include "ckpt/checkpoint_files.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace forge {
namespace {

std::string system_reason() { return std::strerror(errno); }

}  // namespace

DurableFile::DurableFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) FORGE_FAIL("cannot create '{}': {}", path_, system_reason());
}

DurableFile::~DurableFile() {
  if (fd_ >= 0) ::close(fd_);
}

void DurableFile::write(const void* data, size_t size) {
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) FORGE_FAIL("failed writing '{}': {}", path_, system_reason());
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void DurableFile::close() {
  if (::fsync(fd_) != 0) FORGE_FAIL("cannot flush '{}' to disk: {}", path_, system_reason());
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) FORGE_FAIL("failed closing '{}': {}", path_, system_reason());
}

void write_file_durable(const std::string& path, const std::string& contents) {
  DurableFile file(path);
  file.write(contents.data(), contents.size());
  file.close();
}

void fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) FORGE_FAIL("cannot open directory '{}': {}", path, system_reason());
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  errno = saved;
  if (rc != 0) FORGE_FAIL("cannot flush directory '{}' to disk: {}", path, system_reason());
}

bool rename_replacing_directory(const std::string& from, const std::string& to) {
  if (std::filesystem::exists(to)) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) != 0)
      FORGE_FAIL("cannot replace '{}' with '{}': {}", to, from, system_reason());
    return true;
  }
  if (::rename(from.c_str(), to.c_str()) != 0)
    FORGE_FAIL("cannot rename '{}' to '{}': {}", from, to, system_reason());
  return false;
}

FileReader::FileReader(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) FORGE_FAIL("cannot open '{}': {}", path_, system_reason());
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
