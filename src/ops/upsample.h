// Nearest-neighbour 2x upsampling of NHWC activations (NOTE [NHWC activations] in
// ops/conv2d.h), forward only: F.interpolate(x, scale_factor=2, mode="nearest") as the VAE
// decoder's Upsample2D runs it before its convolution.
//   out[b, y, x, c] = in[b, y / 2, x / 2, c]        out [B, 2H, 2W, C], in [B, H, W, C]
// CPU fp32; CUDA bf16 (a copy: no rounding).
#pragma once

#include "core/tensor.h"

namespace forge {

void upsample_nearest2x(const Tensor& out, const Tensor& in);

}  // namespace forge
