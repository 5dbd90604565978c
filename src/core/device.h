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

}  // namespace forge
