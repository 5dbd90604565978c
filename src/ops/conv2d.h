// 2-D convolution of NHWC activations with a bias, forward only: the convolutions of FLUX's
// VAE (3x3 with padding 1, the 1x1 shortcuts and quant convs, and the encoder's stride-2
// downsample padded only at the bottom and the right, NOTE [VAE downsample padding]).
//   out[b, y, x, o] = bias[o] + sum_{dy, dx, i} in[b, y s + dy - top, x s + dx - left, i] w[o, dy, dx, i]
// where the input is zero outside [0, H) x [0, W). Output size: Ho = (H + top + bottom - K) / s + 1,
// Wo = (W + left + right - K) / s + 1 (floor).
//
// NOTE [NHWC activations]
// The VAE keeps its activations as [B, H, W, C] (channels last): a pixel's channels are one
// contiguous row, so a 1x1 convolution is a GEMM over [B H W, C], GroupNorm's affine step
// and the mid-block attention's projections read [B H W, C] as tokens x features without a
// transpose, and cuDNN's fastest convolution kernels take this layout. Weights are stored
// [O, KH, KW, I] (cuDNN's KRSC for NHWC), PyTorch's [O, I, KH, KW] permuted once at load
// (ckpt/flux_vae_weights.h). Images and latents cross into and out of this layout at the
// model's edges only (ops/image_layout.h, ops/vae_latents.h), where the rest of forge and
// diffusers keep [B, C, H, W].
//
// CPU: fp32, each chunk of output pixels gathered into patch rows [pixels, KH KW I] (im2col,
// in the weights' (dy, dx, i) order) and multiplied by the weights' rows; a 1x1 stride-1
// convolution without padding is the GEMM on the input itself. CUDA: bf16 activations and
// weights through cuDNN (fp32 accumulation), then the bias (kernels/cuda/conv2d.cpp).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

struct Conv2dShape {
  int64_t kernel = 3;  // square kernels, KH = KW
  int64_t stride = 1;
  int64_t pad_top = 1, pad_left = 1, pad_bottom = 1, pad_right = 1;

  // 3x3 or 1x1 at stride 1 with the padding that keeps the size ("same").
  static Conv2dShape same(int64_t kernel) {
    const int64_t p = kernel / 2;
    return {kernel, 1, p, p, p, p};
  }
  bool symmetric() const { return pad_top == pad_bottom && pad_left == pad_right; }
};

// [B, Ho, Wo, out_channels] for an input [B, H, W, C]; throws when the kernel does not fit.
Shape conv2d_out_shape(const Shape& in, int64_t out_channels, const Conv2dShape& shape);

// out [B, Ho, Wo, O], in [B, H, W, I], weight [O, K, K, I], bias [O] (undefined: none).
// out must not alias in.
void conv2d_forward(const Tensor& out, const Tensor& in, const Tensor& weight, const Tensor& bias,
                    const Conv2dShape& shape);

}  // namespace forge
