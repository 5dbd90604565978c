// Images between the layout forge's image code and diffusers keep, [B, C, H, W] (channels
// first), and the VAE's NHWC activations [B, H, W, C] (NOTE [NHWC activations] in
// ops/conv2d.h): a transpose at the model's edges.
//   nhwc_from_nchw   out[b, y, x, c] = in[b, c, y, x]
//   nchw_from_nhwc   out[b, c, y, x] = in[b, y, x, c]
// CPU fp32; CUDA bf16 (copies: no rounding).
#pragma once

#include "core/tensor.h"

namespace forge {

void nhwc_from_nchw(const Tensor& out, const Tensor& in);
void nchw_from_nhwc(const Tensor& out, const Tensor& in);

}  // namespace forge
