// host_memory_info; see host_memory.h.
#include "core/host_memory.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <utility>

namespace forge {
namespace {

// "MemAvailable:   12345 kB" from /proc/meminfo, in bytes; -1 when absent.
int64_t meminfo_bytes(const std::string& field) {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::istringstream value(line.substr(field.size() + 1));
    int64_t kib = -1;
    value >> kib;
    return kib >= 0 ? kib * 1024 : -1;
  }
  return -1;
}

// A number of bytes from a cgroup file; -1 when absent, "max" or absurdly large (v1's
// "unlimited" is a number near 2^63).
int64_t cgroup_bytes(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    const int64_t bytes = std::stoll(text);
    return bytes >= 0 && bytes < (int64_t{1} << 60) ? bytes : -1;
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

HostMemoryInfo host_memory_info() {
  HostMemoryInfo info;
  info.total = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  info.available = meminfo_bytes("MemAvailable");
  if (info.available < 0) info.available = info.total;
  for (const auto& [limit_file, usage_file] :
       {std::pair{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
        std::pair{"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"}}) {
    const int64_t limit = cgroup_bytes(limit_file);
    if (limit <= 0) continue;
    const int64_t usage = std::max<int64_t>(cgroup_bytes(usage_file), 0);
    info.total = std::min(info.total, limit);
    info.available = std::min(info.available, std::max<int64_t>(limit - usage, 0));
    break;
  }
  return info;
}

}  // namespace forge
