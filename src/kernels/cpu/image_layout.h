#pragma once

#include <cstdint>

namespace forge::cpu {

// Transposes between [B, C, H, W] and [B, H, W, C] (ops/image_layout.h); `pixels` = H W.
void nhwc_from_nchw(float* out, const float* in, int64_t batch, int64_t channels, int64_t pixels);
void nchw_from_nhwc(float* out, const float* in, int64_t batch, int64_t channels, int64_t pixels);

}  // namespace forge::cpu
