#include "core/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace forge {
namespace {

std::string system_reason() { return std::strerror(errno); }

void fsync_parent_directory(const std::string& path) {
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) FORGE_FAIL("cannot open directory '{}': {}", dir, system_reason());
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  errno = saved;
  if (rc != 0) FORGE_FAIL("cannot flush directory '{}' to disk: {}", dir, system_reason());
}

}  // namespace

AtomicFile::AtomicFile(std::string path, DurableOptions options)
    : path_(std::move(path)), temporary_(path_ + ".tmp-" + std::to_string(::getpid())), options_(options) {
  fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) FORGE_FAIL("cannot create '{}': {}", temporary_, system_reason());
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!committed_) ::unlink(temporary_.c_str());
}

void AtomicFile::write(const void* data, size_t size) {
  FORGE_CHECK(fd_ >= 0, "write to '{}' after commit", path_);
  const auto* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd_, p, size);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) FORGE_FAIL("failed writing '{}': {}", temporary_, n == 0 ? "no progress" : system_reason());
    p += n;
    size -= static_cast<size_t>(n);
  }
}

void AtomicFile::commit() {
  FORGE_CHECK(fd_ >= 0, "'{}' committed twice", path_);
  if (options_.sync && ::fsync(fd_) != 0) FORGE_FAIL("cannot flush '{}' to disk: {}", temporary_, system_reason());
  int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) FORGE_FAIL("failed closing '{}': {}", temporary_, system_reason());
  if (::rename(temporary_.c_str(), path_.c_str()) != 0)
    FORGE_FAIL("cannot rename '{}' to '{}': {}", temporary_, path_, system_reason());
  committed_ = true;
  if (options_.sync) fsync_parent_directory(path_);
}

void write_file_atomic(const std::string& path, std::string_view contents, DurableOptions options) {
  AtomicFile file(path, options);
  file.write(contents.data(), contents.size());
  file.commit();
}

}  // namespace forge
