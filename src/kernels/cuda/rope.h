#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// x bf16 [batch, seq, heads, head_dim]; the first rotated_heads heads of every position are
// rotated in place by the fp32 tables cos/sin [> max position, head_dim / 2], at position
// positions[b * seq + t] (int32, device) when given, else t. inverse: the backward.
void rope_rotate(bf16* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t rotated_heads,
                 const float* cos, const float* sin, const int32_t* positions, bool inverse);

}  // namespace forge::cuda
