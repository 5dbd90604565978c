// Owning buffers for the preflight measurements: device memory on one GPU (freed with that
// GPU current) and page-locked host memory. Move-only; errors are forge::Error.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

#include "kernels/cuda/cuda_check.h"

namespace forge::bench_cuda {

class DeviceBuffer {
 public:
  DeviceBuffer(int device, size_t bytes) : device_(device), bytes_(bytes) {
    CUDA_CHECK(cudaSetDevice(device));
    CUDA_CHECK(cudaMalloc(&data_, bytes));
  }
  ~DeviceBuffer() {
    if (!data_) return;
    int current = 0;
    cudaGetDevice(&current);
    cudaSetDevice(device_);
    cudaFree(data_);
    cudaSetDevice(current);
  }
  DeviceBuffer(DeviceBuffer&& other) noexcept
      : device_(other.device_), bytes_(other.bytes_), data_(std::exchange(other.data_, nullptr)) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(DeviceBuffer&&) = delete;

  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  int device_;
  size_t bytes_;
  void* data_ = nullptr;
};

class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) { CUDA_CHECK(cudaMallocHost(&data_, bytes)); }
  ~PinnedBuffer() {
    if (data_) cudaFreeHost(data_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_;
  void* data_ = nullptr;
};

}  // namespace forge::bench_cuda
