#include "kernels/cuda/scratch.h"

#include <array>
#include <mutex>

#include "core/device.h"

namespace forge::cuda {
namespace {

struct Buffer {
  void* ptr = nullptr;
  size_t bytes = 0;
};

std::mutex g_mu;
std::array<Buffer, static_cast<size_t>(ScratchSlot::Count)> g_buffers;

}  // namespace

void* scratch_buffer(ScratchSlot slot, size_t bytes) {
  std::lock_guard lock(g_mu);
  Buffer& b = g_buffers[static_cast<size_t>(slot)];
  if (bytes > b.bytes) {
    device_free(b.ptr);  // synchronizes, so no kernel still uses the old buffer
    b.ptr = device_malloc(bytes);
    b.bytes = bytes;
  }
  return b.ptr;
}

}  // namespace forge::cuda
