// What preflight lists about the GPUs and the CUDA stack, straight from the CUDA runtime
// and NCCL (no NVML: forge does not link it). Clocks are the peak clocks the device
// reports, not the current ones, which fall when the GPU idles.
#include <nccl.h>

#include <fmt/format.h>

#include "bench/preflight_measure.h"
#include "kernels/cuda/cuda_check.h"

namespace forge {
namespace {

// CUDA encodes versions as 1000 * major + 10 * minor.
std::string cuda_version(int code) { return fmt::format("{}.{}", code / 1000, code % 1000 / 10); }

int attribute(cudaDeviceAttr attr, int gpu) {
  int value = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, gpu));
  return value;
}

}  // namespace

int visible_gpu_count() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status == cudaErrorNoDevice) return 0;
  if (status != cudaSuccess) {
    FORGE_FAIL("forge preflight: CUDA cannot use the GPUs: {} ({})", cudaGetErrorString(status),
               cudaGetErrorName(status));
  }
  return count;
}

GpuInfo query_gpu(int index) {
  GpuInfo g;
  g.index = index;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, index));
  g.name = prop.name;
  g.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
  g.compute_major = prop.major;
  g.compute_minor = prop.minor;
  g.max_sm_clock_mhz = attribute(cudaDevAttrClockRate, index) / 1000;
  g.max_memory_clock_mhz = attribute(cudaDevAttrMemoryClockRate, index) / 1000;
  g.ecc_enabled = attribute(cudaDevAttrEccEnabled, index) != 0;
  char bus_id[64] = {};
  CUDA_CHECK(cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), index));
  g.pci_bus_id = bus_id;
  return g;
}

SystemInfo query_cuda_versions() {
  SystemInfo s;
  int driver = 0, runtime = 0, nccl = 0;
  CUDA_CHECK(cudaDriverGetVersion(&driver));
  CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  s.cuda_driver_version = driver ? cuda_version(driver) : "";
  s.cuda_runtime_version = cuda_version(runtime);
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    // NCCL 2.9+ encodes 10000 * major + 100 * minor + patch.
    s.nccl_version = fmt::format("{}.{}.{}", nccl / 10000, nccl % 10000 / 100, nccl % 100);
  }
  return s;
}

}  // namespace forge
