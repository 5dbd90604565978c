// Nearest 2x upsampling of NHWC bf16 activations: a copy, one thread per 8 consecutive
// output channels of a pixel (16-byte loads and stores when the channels are a multiple of
// 8 and both pointers 16-byte aligned; otherwise one thread per element). Consecutive
// threads write consecutive memory; each input pixel is read by the four threads (groups)
// of its 2x2 output block.
#include "kernels/cuda/upsample.h"

#include <cstdint>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

// `unit` elements (8: one uint4; 1: one bf16) per thread; channels a multiple of unit.
template <typename Unit>
__global__ void upsample_kernel(Unit* out, const Unit* in, int64_t height, int64_t width, int64_t units,
                                int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t c = i % units, x = i / units % (2 * width), y = i / (units * 2 * width) % (2 * height);
  const int64_t b = i / (units * 4 * width * height);
  out[i] = in[((b * height + y / 2) * width + x / 2) * units + c];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void upsample_nearest2x(bf16* out, const bf16* in, int64_t batch, int64_t height, int64_t width, int64_t channels) {
  const bool vector = channels % 8 == 0 && aligned16(out) && aligned16(in);
  const int64_t units = vector ? channels / 8 : channels;
  const int64_t total = batch * 4 * height * width * units;
  if (total == 0) return;
  const auto blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
  if (vector)
    upsample_kernel<<<blocks, kThreads>>>(reinterpret_cast<uint4*>(out), reinterpret_cast<const uint4*>(in), height,
                                          width, units, total);
  else
    upsample_kernel<<<blocks, kThreads>>>(out, in, height, width, units, total);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
