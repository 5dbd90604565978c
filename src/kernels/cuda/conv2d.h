#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// A convolution of NHWC bf16 activations (ops/conv2d.h) with padding `pad` on every side:
// in [B, H, W, I], weight [O, K, K, I], out [B, Ho, Wo, O] with Ho = (H + 2 pad - K) / stride + 1.
struct Conv2dProblem {
  int64_t batch, height, width, in_channels, out_channels, kernel, stride, pad;
};

// out = conv(in, weight), no bias, through cuDNN (fp32 accumulation).
void conv2d_forward(bf16* out, const bf16* in, const bf16* weight, const Conv2dProblem& p);

// out [B, top + H + bottom, left + W + right, C] = in [B, H, W, C] surrounded by zeros.
void pad_nhwc(bf16* out, const bf16* in, int64_t batch, int64_t height, int64_t width, int64_t channels, int64_t top,
              int64_t left, int64_t bottom, int64_t right);

}  // namespace forge::cuda
