// Device memory and copies behind Tensor. With the CUDA backend built in (FORGE_CUDA),
// CUDA tensors live in memory from cudaMalloc and copies go through cudaMemcpy; without
// it, asking for device memory is a clear error. Kernels never call these: they get
// pointers from tensors the model layer allocated.
#pragma once

#include <cstddef>
#include <string>

#include "core/dtype.h"

struct CUstream_st;

namespace forge {

// A cudaStream_t, named without CUDA's headers; nullptr is the legacy default stream,
// the one forge's kernels run on.
using CudaStream = CUstream_st*;

// True when this build has the CUDA backend and a GPU is visible.
bool cuda_available();
// Name of the current GPU ("cpu" when there is none).
std::string accelerator_name();
// Compute capability of the current GPU as "sm_90"; empty when there is none.
std::string accelerator_architecture();

// Device memory. An allocation that fails throws OutOfMemoryError.
void* device_malloc(size_t bytes);
void device_free(void* ptr);

// Bytes held through device_malloc now, and the most held at once since the last reset
// (the allocator's high-water mark that forge reports as peak memory).
size_t device_memory_in_use();
size_t device_memory_peak();
void reset_device_memory_peak();

// Free and total memory of the current GPU as the driver reports them (everything on the
// device counts: other processes, the CUDA context, library workspaces).
struct DeviceMemoryInfo {
  size_t free = 0;
  size_t total = 0;
};
DeviceMemoryInfo device_memory_info();
void device_memset_zero(void* ptr, size_t bytes);
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void device_synchronize();
// copy_bytes in the order of `stream` (a DeviceStream's; nullptr: the legacy default
// stream): returns once the copy is enqueued, so the caller synchronizes the stream before
// it reads the destination or reuses the source. Between two CPU buffers, a memcpy.
void copy_bytes_on(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes, CudaStream stream);
// `height` rows of `width` bytes from src (rows `src_pitch` bytes apart) to dst (rows
// `dst_pitch` apart), both on `device`; on CUDA enqueued on the legacy default stream, where
// forge's kernels run (cudaMemcpy2DAsync).
void copy_bytes_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t height,
                   Device device);
// The GPU this thread works on (cudaGetDevice; 0 without CUDA), and making a new thread
// work on the same one as the thread that started it.
int current_device_index();
void set_current_device_index(int index);

// NOTE [Pinned host buffers]
// Host memory that the GPU copies to and from at full speed (cudaMallocHost: page-locked,
// so a copy needs no bounce through a driver buffer), for staging that is reused many
// times, as checkpoint saves and loads do. Without a GPU (a CPU build, or no device
// visible) it is ordinary host memory. Page-locked memory is taken from the machine's
// memory for good while it is held, so only bounded buffers are pinned.
class PinnedHostBuffer {
 public:
  explicit PinnedHostBuffer(size_t bytes);
  ~PinnedHostBuffer();
  PinnedHostBuffer(const PinnedHostBuffer&) = delete;
  PinnedHostBuffer& operator=(const PinnedHostBuffer&) = delete;
  void* data() const { return data_; }
  size_t size() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool pinned_ = false;
};
// Zeroes `bytes` at ptr in stream order on `stream` (device memory).
void device_memset_zero_on(void* ptr, size_t bytes, CudaStream stream);

// NOTE [Streams and events]
// forge's kernels run on the legacy default stream (nullptr). Communication that should
// overlap with them (FSDP's all-gathers and reduce-scatters) runs on a DeviceStream of its
// own, and DeviceEvents order the two: record() marks the point a stream has reached,
// make_wait() makes another stream wait for that point without blocking the host. On the
// CPU both are empty: there every operation is done when its call returns.
class DeviceStream {
 public:
  explicit DeviceStream(Device device);  // a non-blocking CUDA stream; nothing on the CPU
  ~DeviceStream();
  DeviceStream(const DeviceStream&) = delete;
  DeviceStream& operator=(const DeviceStream&) = delete;
  CudaStream get() const { return stream_; }
  void synchronize() const;  // the host waits for the stream's work

 private:
  CudaStream stream_ = nullptr;
};

class DeviceEvent {
 public:
  // A CUDA event (with timing only when asked for); nothing on the CPU.
  explicit DeviceEvent(Device device, bool timing = false);
  ~DeviceEvent();
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  // Marks the point `stream` has reached with the work enqueued so far.
  void record(CudaStream stream);
  // Work enqueued on `stream` from now on starts after the recorded point (no-op when
  // never recorded).
  void make_wait(CudaStream stream) const;
  void synchronize() const;  // the host waits for the recorded point
  // Seconds between two recorded timing events (waits for `end`); 0 on the CPU.
  static double elapsed_seconds(const DeviceEvent& start, const DeviceEvent& end);

 private:
  void* event_ = nullptr;  // cudaEvent_t
  bool recorded_ = false;
};

}  // namespace forge
