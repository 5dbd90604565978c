#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// out, in bf16 [batch, pixels, channels] (NHWC; out may be in); weight, bias bf16 [channels];
// channels a multiple of groups (ops/group_norm.h).
void group_norm_forward(bf16* out, const bf16* in, const bf16* weight, const bf16* bias, int64_t batch, int64_t pixels,
                        int64_t channels, int64_t groups, float eps, bool silu);

}  // namespace forge::cuda
