#pragma once

#include <cstdint>

namespace forge::cpu {

// The sizes of a convolution of NHWC activations (ops/conv2d.h).
struct Conv2dDims {
  int64_t batch = 0, height = 0, width = 0, in_channels = 0, out_channels = 0;
  int64_t kernel = 0, stride = 1;
  int64_t pad_top = 0, pad_left = 0, pad_bottom = 0, pad_right = 0;

  int64_t out_height() const { return (height + pad_top + pad_bottom - kernel) / stride + 1; }
  int64_t out_width() const { return (width + pad_left + pad_right - kernel) / stride + 1; }
};

// out [B, Ho, Wo, O] = conv(in [B, H, W, I], weight [O, K, K, I]) + bias [O] (bias may be null).
void conv2d_forward(float* out, const float* in, const float* weight, const float* bias, const Conv2dDims& d);

}  // namespace forge::cpu
