#pragma once

#include <cstdint>

namespace forge::cpu {

// out, in [batch, pixels, channels] (NHWC; out may be in); weight, bias [channels]; channels
// a multiple of groups.
void group_norm_forward(float* out, const float* in, const float* weight, const float* bias, int64_t batch,
                        int64_t pixels, int64_t channels, int64_t groups, float eps, bool silu);

}  // namespace forge::cpu
