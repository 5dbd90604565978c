#include "core/page_cache.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "core/error.h"

namespace forge {
namespace {

void evict_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) FORGE_FAIL("'{}': cannot open to evict it from the page cache: {}", path, std::strerror(errno));
  const int error = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  if (error != 0) FORGE_FAIL("'{}': posix_fadvise(DONTNEED) failed: {}", path, std::strerror(error));
}

}  // namespace

int evict_from_page_cache(const std::vector<std::string>& paths) {
  int evicted = 0;
  for (const std::string& path : paths) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) {
      for (const auto& entry : std::filesystem::directory_iterator(path, ec)) {
        if (!entry.is_regular_file(ec)) continue;
        evict_file(entry.path().string());
        ++evicted;
      }
    } else if (std::filesystem::is_regular_file(path, ec)) {
      evict_file(path);
      ++evicted;
    }
  }
  return evicted;
}

}  // namespace forge
