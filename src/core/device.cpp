#include "core/device.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "core/error.h"

#ifdef FORGE_CUDA
#include <cuda_runtime.h>
#endif

namespace forge {
namespace {

std::mutex g_mu;
std::unordered_map<void*, size_t> g_sizes;
size_t g_in_use = 0;  // bytes held through device_malloc
size_t g_peak = 0;    // most bytes held at once since the last reset

#ifdef FORGE_CUDA
void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) FORGE_FAIL("CUDA error in {}: {} ({})", what, cudaGetErrorString(e), static_cast<int>(e));
}
#endif

#ifndef FORGE_CUDA
[[noreturn]] void no_cuda(const char* what) {
  FORGE_FAIL("{}: this build of forge has no CUDA backend (configure with -DFORGE_CUDA=ON)", what);
}
#endif

}  // namespace

bool cuda_available() {
#ifdef FORGE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

std::string accelerator_name() {
#ifdef FORGE_CUDA
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) == cudaSuccess && cudaGetDeviceProperties(&prop, device) == cudaSuccess) return prop.name;
#endif
  return "cpu";
}

std::string accelerator_architecture() {
#ifdef FORGE_CUDA
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) == cudaSuccess && cudaGetDeviceProperties(&prop, device) == cudaSuccess)
    return "sm_" + std::to_string(prop.major * 10 + prop.minor);
#endif
  return "";
}

void* device_malloc(size_t bytes) {
#ifdef FORGE_CUDA
  void* p = nullptr;
  cudaError_t e = cudaMalloc(&p, std::max<size_t>(bytes, 1));
  if (e != cudaSuccess) {
    cudaGetLastError();
    size_t free_bytes = 0, total = 0;
    cudaMemGetInfo(&free_bytes, &total);
    throw OutOfMemoryError(fmt::format(
        "out of GPU memory: asked for {:.2f} GiB with {:.2f} GiB free of {:.2f} GiB ({:.2f} GiB held by forge)",
        bytes / 1073741824.0, free_bytes / 1073741824.0, total / 1073741824.0, g_in_use / 1073741824.0));
  }
  std::lock_guard lock(g_mu);
  g_sizes[p] = bytes;
  g_in_use += bytes;
  g_peak = std::max(g_peak, g_in_use);
  return p;
#else
  (void)bytes;
  no_cuda("device_malloc");
#endif
}

void device_free(void* ptr) {
#ifdef FORGE_CUDA
  if (!ptr) return;
  {
    std::lock_guard lock(g_mu);
    auto it = g_sizes.find(ptr);
    if (it != g_sizes.end()) {
      g_in_use -= it->second;
      g_sizes.erase(it);
    }
  }
  cudaFree(ptr);
#else
  (void)ptr;
#endif
}

size_t device_memory_in_use() {
  std::lock_guard lock(g_mu);
  return g_in_use;
}

size_t device_memory_peak() {
  std::lock_guard lock(g_mu);
  return g_peak;
}

void reset_device_memory_peak() {
  std::lock_guard lock(g_mu);
  g_peak = g_in_use;
}

DeviceMemoryInfo device_memory_info() {
  DeviceMemoryInfo info;
#ifdef FORGE_CUDA
  cuda_check(cudaMemGetInfo(&info.free, &info.total), "cudaMemGetInfo");
#endif
  return info;
}

void device_memset_zero(void* ptr, size_t bytes) {
#ifdef FORGE_CUDA
  cuda_check(cudaMemsetAsync(ptr, 0, bytes), "cudaMemsetAsync");
#else
  (void)ptr;
  (void)bytes;
  no_cuda("device_memset_zero");
#endif
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device == Device::CPU && src_device == Device::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef FORGE_CUDA
  cuda_check(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault), "cudaMemcpy");
#else
  no_cuda("copy_bytes");
#endif
}

void copy_bytes_on(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                   CudaStream stream) {
  if (bytes == 0) return;
  if (dst_device == Device::CPU && src_device == Device::CPU) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef FORGE_CUDA
  cuda_check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
#else
  (void)stream;
  no_cuda("copy_bytes_on");
#endif
}

void copy_bytes_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                   Device device) {
  if (width == 0 || height == 0) return;
  if (device == Device::CPU) {
    for (size_t row = 0; row < height; ++row)
      std::memcpy(static_cast<char*>(dst) + row * dst_pitch, static_cast<const char*>(src) + row * src_pitch, width);
    return;
  }
#ifdef FORGE_CUDA
  cuda_check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault, nullptr),
             "cudaMemcpy2DAsync");
#else
  (void)dst_pitch;
  (void)src_pitch;
  no_cuda("copy_bytes_2d");
#endif
}

int current_device_index() {
#ifdef FORGE_CUDA
  int device = 0;
  if (cudaGetDevice(&device) == cudaSuccess) return device;
  cudaGetLastError();
#endif
  return 0;
}

void set_current_device_index(int index) {
#ifdef FORGE_CUDA
  if (cuda_available()) cuda_check(cudaSetDevice(index), "cudaSetDevice");
#else
  (void)index;
#endif
}

PinnedHostBuffer::PinnedHostBuffer(size_t bytes) : bytes_(bytes) {
  const size_t size = std::max<size_t>(bytes, 1);
#ifdef FORGE_CUDA
  if (cuda_available()) {
    if (cudaMallocHost(&data_, size) == cudaSuccess) {
      pinned_ = true;
      return;
    }
    cudaGetLastError();
    data_ = nullptr;
  }
#endif
  data_ = std::malloc(size);
  if (!data_) throw OutOfMemoryError(fmt::format("out of host memory: asked for {:.1f} MiB of staging", size / 1048576.0));
}

PinnedHostBuffer::~PinnedHostBuffer() {
#ifdef FORGE_CUDA
  if (pinned_) {
    cudaFreeHost(data_);
    return;
  }
#endif
  std::free(data_);
}

void device_synchronize() {
#ifdef FORGE_CUDA
  cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
#endif
}

void device_memset_zero_on(void* ptr, size_t bytes, CudaStream stream) {
#ifdef FORGE_CUDA
  cuda_check(cudaMemsetAsync(ptr, 0, bytes, stream), "cudaMemsetAsync");
#else
  (void)ptr;
  (void)bytes;
  (void)stream;
  no_cuda("device_memset_zero_on");
#endif
}

DeviceStream::DeviceStream(Device device) {
  if (device != Device::CUDA) return;
#ifdef FORGE_CUDA
  cudaStream_t s = nullptr;
  cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  stream_ = s;
#else
  no_cuda("DeviceStream");
#endif
}

DeviceStream::~DeviceStream() {
#ifdef FORGE_CUDA
  if (stream_) cudaStreamDestroy(stream_);
#endif
}

void DeviceStream::synchronize() const {
#ifdef FORGE_CUDA
  if (stream_) cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
#endif
}

DeviceEvent::DeviceEvent(Device device, bool timing) {
  if (device != Device::CUDA) return;
#ifdef FORGE_CUDA
  cudaEvent_t e = nullptr;
  cuda_check(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreateWithFlags");
  event_ = e;
#else
  (void)timing;
  no_cuda("DeviceEvent");
#endif
}

DeviceEvent::~DeviceEvent() {
#ifdef FORGE_CUDA
  if (event_) cudaEventDestroy(static_cast<cudaEvent_t>(event_));
#endif
}

void DeviceEvent::record(CudaStream stream) {
#ifdef FORGE_CUDA
  if (event_) cuda_check(cudaEventRecord(static_cast<cudaEvent_t>(event_), stream), "cudaEventRecord");
#endif
  (void)stream;
  recorded_ = true;
}

void DeviceEvent::make_wait(CudaStream stream) const {
#ifdef FORGE_CUDA
  if (event_ && recorded_)
    cuda_check(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event_), 0), "cudaStreamWaitEvent");
#endif
  (void)stream;
}

void DeviceEvent::synchronize() const {
#ifdef FORGE_CUDA
  if (event_ && recorded_) cuda_check(cudaEventSynchronize(static_cast<cudaEvent_t>(event_)), "cudaEventSynchronize");
#endif
}

double DeviceEvent::elapsed_seconds(const DeviceEvent& start, const DeviceEvent& end) {
#ifdef FORGE_CUDA
  if (!start.event_ || !end.event_ || !start.recorded_ || !end.recorded_) return 0.0;
  end.synchronize();
  float ms = 0.0f;
  cuda_check(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.event_), static_cast<cudaEvent_t>(end.event_)),
             "cudaEventElapsedTime");
  return ms / 1e3;
#else
  (void)start;
  (void)end;
  return 0.0;
#endif
}

}  // namespace forge
