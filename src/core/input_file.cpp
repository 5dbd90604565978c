// Regular-file checks for user input; see NOTE [User files must be regular files].
#include "core/input_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace forge {
namespace {

const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a named pipe";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a plain file";
}

[[noreturn]] void fail_kind(const std::string& path, std::string_view what, mode_t mode) {
  FORGE_FAIL("{}: {} is {}, not a regular file", path, what, kind_of(mode));
}

}  // namespace

void require_regular_file(const std::string& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) FORGE_FAIL("{}: cannot open {}: {}", path, what, std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail_kind(path, what, st.st_mode);
}

int open_regular_file(const std::string& path, std::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) FORGE_FAIL("{}: cannot open {}: {}", path, what, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    FORGE_FAIL("{}: cannot read {}: {}", path, what, std::strerror(error));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail_kind(path, what, st.st_mode);
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int error = errno;
    ::close(fd);
    FORGE_FAIL("{}: cannot read {}: {}", path, what, std::strerror(error));
  }
  return fd;
}

std::string read_regular_file(const std::string& path, std::string_view what) {
  const int fd = open_regular_file(path, what);
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd, buffer, sizeof(buffer));
    if (n > 0) {
      text.append(buffer, static_cast<size_t>(n));
    } else if (n == 0) {
      break;
    } else if (errno != EINTR) {
      const int error = errno;
      ::close(fd);
      FORGE_FAIL("{}: cannot read {}: {}", path, what, std::strerror(error));
    }
  }
  ::close(fd);
  return text;
}

}  // namespace forge
