// How much host memory this machine has for a new allocation: the kernel's MemAvailable
// estimate (free memory plus what it can reclaim), capped by the cgroup's memory limit
// when the process runs under one (containers, Slurm jobs).
#pragma once

#include <cstdint>

namespace forge {

struct HostMemoryInfo {
  int64_t available = 0;  // bytes
  int64_t total = 0;      // bytes: physical memory, or the cgroup limit when lower
};

HostMemoryInfo host_memory_info();

}  // namespace forge
