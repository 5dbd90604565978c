// AtomicFile and fsync_directory; see NOTE [Durable files] in core/durable_file.h.
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

}  // namespace

std::string temporary_path_for(const std::string& target, int64_t pid) {
  // The host name too: processes of two hosts writing into one shared directory (an NFS
  // home, a cluster file system) can have the same pid.
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::snprintf(host, sizeof(host), "host");
  for (char* c = host; *c; ++c)
    if (*c == '/') *c = '_';
  return target + ".tmp-" + host + "-" + std::to_string(pid);
}

AtomicFile::AtomicFile(std::string path, DurableOptions options)
    : path_(std::move(path)), temporary_(temporary_path_for(path_, ::getpid())), options_(options) {
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

void fsync_directory(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) FORGE_FAIL("cannot open directory '{}': {}", path, system_reason());
  int rc = ::fsync(fd);
  int saved = errno;
  ::close(fd);
  errno = saved;
  if (rc != 0) FORGE_FAIL("cannot flush directory '{}' to disk: {}", path, system_reason());
}

void fsync_parent_directory(const std::string& path) {
  const std::string parent = std::filesystem::path(path).parent_path().string();
  fsync_directory(parent.empty() ? "." : parent);
}

}  // namespace forge
