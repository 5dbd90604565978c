// Zero padding of NHWC bf16 activations, for a convolution whose padding cuDNN is not given
// (NOTE [VAE downsample padding] in ops/conv2d.cpp): out [B, top + H + bottom, left + W +
// right, C] holds in [B, H, W, C] at offset (top, left) and zeros around it.
// One thread per output element, consecutive threads on consecutive channels (coalesced
// reads and writes); memory-bound and run on the three downsample inputs of an encode only.
#include "kernels/cuda/conv2d.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void pad_kernel(bf16* out, const bf16* in, int64_t height, int64_t width, int64_t channels, int64_t top,
                           int64_t left, int64_t out_height, int64_t out_width, int64_t total) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t c = i % channels, x = i / channels % out_width, y = i / (channels * out_width) % out_height;
  const int64_t b = i / (channels * out_width * out_height);
  const int64_t iy = y - top, ix = x - left;
  const bool inside = iy >= 0 && iy < height && ix >= 0 && ix < width;
  out[i] = inside ? in[((b * height + iy) * width + ix) * channels + c] : __float2bfloat16(0.0f);
}

}  // namespace

void pad_nhwc(bf16* out, const bf16* in, int64_t batch, int64_t height, int64_t width, int64_t channels, int64_t top,
              int64_t left, int64_t bottom, int64_t right) {
  const int64_t out_height = top + height + bottom, out_width = left + width + right;
  const int64_t total = batch * out_height * out_width * channels;
  if (total == 0) return;
  const auto blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
  pad_kernel<<<blocks, kThreads>>>(out, in, height, width, channels, top, left, out_height, out_width, total);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
