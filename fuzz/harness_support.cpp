#include "harness_support.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace forge::fuzz {

namespace {

std::string make_temp_dir() {
  std::string base = std::filesystem::is_directory("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path().string();
  std::string pattern = base + "/forge-fuzz-XXXXXX";
  if (!mkdtemp(pattern.data())) {
    std::perror("forge fuzz: mkdtemp");
    std::abort();
  }
  return pattern;
}

struct TempDir {
  std::string path = make_temp_dir();
  pid_t owner = getpid();
  ~TempDir() {
    std::error_code ignored;
    if (getpid() == owner) std::filesystem::remove_all(path, ignored);
  }
};

}  // namespace

const std::string& temp_dir() {
  static TempDir dir;
  return dir.path;
}

std::string write_temp_file(const std::string& name, std::string_view bytes) {
  // Plain system calls: an ofstream's buffer and locale cost more than the write itself,
  // once per input.
  std::string path = temp_dir() + "/" + name;
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  bool written = fd >= 0;
  for (size_t done = 0; written && done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    written = n > 0;
    if (written) done += static_cast<size_t>(n);
  }
  if (fd >= 0 && ::close(fd) != 0) written = false;
  if (!written) {
    std::fprintf(stderr, "forge fuzz: cannot write %s: %s\n", path.c_str(), std::strerror(errno));
    std::abort();
  }
  return path;
}

void expect_only_forge_errors(const std::function<void()>& parse) {
  try {
    parse();
  } catch (const Error&) {
  } catch (const std::filesystem::filesystem_error&) {
    // forge's commands report these as bad input, naming the path (core/filesystem_error.h).
  }
}

std::pair<std::string_view, std::string_view> split_at_nul(std::string_view data) {
  size_t nul = data.find('\0');
  if (nul == std::string_view::npos) return {data, {}};
  return {data.substr(0, nul), data.substr(nul + 1)};
}

}  // namespace forge::fuzz
