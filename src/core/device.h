// Device memory and copies behind Tensor. With the CUDA backend built in (FORGE_CUDA),
// CUDA tensors live in memory from cudaMalloc and copies go through cudaMemcpy; without
// it, asking for device memory is a clear error. Kernels never call these: they get
// pointers from tensors the model layer allocated.
#pragma once

#include <cstddef>
#include <string>

#include "core/dtype.h"

namespace forge {

// True when this build has the CUDA backend and a GPU is visible.
bool cuda_available();
// Name of the current GPU ("cpu" when there is none).
std::string accelerator_name();

void* device_malloc(size_t bytes);
void device_free(void* ptr);
void device_memset_zero(void* ptr, size_t bytes);
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void device_synchronize();

}  // namespace forge
