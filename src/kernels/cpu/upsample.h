#pragma once

#include <cstdint>

namespace forge::cpu {

// out [B, 2H, 2W, C] = in [B, H, W, C] repeated 2x2 (ops/upsample.h).
void upsample_nearest2x(float* out, const float* in, int64_t batch, int64_t height, int64_t width, int64_t channels);

}  // namespace forge::cpu
