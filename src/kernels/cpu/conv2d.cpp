// Convolution of NHWC activations on the CPU (ops/conv2d.h), as patch rows times weights.
//
// For a chunk of output pixels, row p of the patch matrix holds the K x K x I input values
// pixel p reads, in the weights' (dy, dx, i) order: K runs of I contiguous channels (zero
// where the window leaves the input). The chunk's outputs are then one GEMM,
// out[pixels, O] = patches[pixels, K K I] @ weight[O, K K I]^T, the GEMM's "dot" form over
// contiguous rows of both (kernels/cpu/matmul.cpp), and the bias is added to every row.
// Chunks hold at most kPatchFloats values, so the patch matrix stays a few MB at any image
// size. A 1x1 convolution at stride 1 without padding reads each pixel's own channels: the
// GEMM runs on the input directly. Outputs are summed in an order fixed by the shapes (NOTE
// [Deterministic CPU parallelism]).
#include "kernels/cpu/conv2d.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/parallel.h"
#include "kernels/cpu/bias.h"
#include "kernels/cpu/matmul.h"

namespace forge::cpu {
namespace {

constexpr int64_t kPatchFloats = int64_t{1} << 20;  // 4 MB of patch rows per chunk

// Rows [first, first + count) of the patch matrix (output pixels in [B, Ho, Wo] order).
void gather_patches(float* patches, const float* in, const Conv2dDims& d, int64_t first, int64_t count) {
  const int64_t ho = d.out_height(), wo = d.out_width(), k = d.kernel, c = d.in_channels;
  const int64_t row = k * k * c;
  parallel_for(count, std::max<int64_t>(1, 4096 / row), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t pixel = first + p;
      const int64_t b = pixel / (ho * wo), y = pixel / wo % ho, x = pixel % wo;
      float* dst = patches + p * row;
      for (int64_t dy = 0; dy < k; ++dy) {
        const int64_t iy = y * d.stride + dy - d.pad_top;
        for (int64_t dx = 0; dx < k; ++dx) {
          const int64_t ix = x * d.stride + dx - d.pad_left;
          float* run = dst + (dy * k + dx) * c;
          if (iy < 0 || iy >= d.height || ix < 0 || ix >= d.width)
            std::fill_n(run, c, 0.0f);
          else
            std::memcpy(run, in + ((b * d.height + iy) * d.width + ix) * c, static_cast<size_t>(c) * sizeof(float));
        }
      }
    }
  });
}

}  // namespace

void conv2d_forward(float* out, const float* in, const float* weight, const float* bias, const Conv2dDims& d) {
  const int64_t pixels = d.batch * d.out_height() * d.out_width();
  const int64_t row = d.kernel * d.kernel * d.in_channels;
  const bool direct = d.kernel == 1 && d.stride == 1 && d.pad_top == 0 && d.pad_left == 0 && d.pad_bottom == 0 &&
                      d.pad_right == 0;
  if (direct) {
    matmul(out, in, false, weight, true, pixels, d.out_channels, row, 1.0f, 0.0f);
  } else {
    const int64_t chunk = std::max<int64_t>(1, kPatchFloats / row);
    std::vector<float> patches(static_cast<size_t>(std::min(chunk, pixels) * row));
    for (int64_t first = 0; first < pixels; first += chunk) {
      const int64_t count = std::min(chunk, pixels - first);
      gather_patches(patches.data(), in, d, first, count);
      matmul(out + first * d.out_channels, patches.data(), false, weight, true, count, d.out_channels, row, 1.0f,
             0.0f);
    }
  }
  if (bias) add_bias(out, bias, pixels, d.out_channels);
}

}  // namespace forge::cpu
