#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// bf16 transposes between [B, C, H, W] and [B, H, W, C] (ops/image_layout.h); pixels = H W.
void nhwc_from_nchw(bf16* out, const bf16* in, int64_t batch, int64_t channels, int64_t pixels);
void nchw_from_nhwc(bf16* out, const bf16* in, int64_t batch, int64_t channels, int64_t pixels);

}  // namespace forge::cuda
