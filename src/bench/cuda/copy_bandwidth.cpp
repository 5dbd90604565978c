// Copy bandwidth for preflight: a copy within one GPU's memory, which is what HBM can
// stream (every elementwise op, norm and optimizer step is bound by it), and a copy from
// page-locked host memory, which is how fast data and checkpoints reach the GPU over its
// PCIe link. Both are single cudaMemcpyAsync calls, timed as NOTE [Preflight timing].
#include <cstring>

#include "bench/cuda/device_buffer.h"
#include "bench/cuda/event_timing.h"
#include "bench/preflight_measure.h"
#include "kernels/cuda/cuda_check.h"

namespace forge {

double measure_device_copy_gbps(int gpu, size_t bytes) {
  bench_cuda::DeviceBuffer source(gpu, bytes), target(gpu, bytes);
  CUDA_CHECK(cudaMemset(source.get(), 0x5a, bytes));
  const double seconds = bench_cuda::median_call_seconds({{gpu, nullptr}}, [&] {
    CUDA_CHECK(cudaMemcpyAsync(target.get(), source.get(), bytes, cudaMemcpyDeviceToDevice, nullptr));
  });
  return 2.0 * static_cast<double>(bytes) / seconds / 1e9;
}

double measure_host_to_device_gbps(int gpu, size_t bytes) {
  bench_cuda::PinnedBuffer source(bytes);
  std::memset(source.get(), 0x5a, bytes);
  bench_cuda::DeviceBuffer target(gpu, bytes);
  const double seconds = bench_cuda::median_call_seconds({{gpu, nullptr}}, [&] {
    CUDA_CHECK(cudaMemcpyAsync(target.get(), source.get(), bytes, cudaMemcpyHostToDevice, nullptr));
  });
  return static_cast<double>(bytes) / seconds / 1e9;
}

}  // namespace forge
