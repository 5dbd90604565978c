#pragma once

#include <cstdint>

namespace forge::cpu {

// x is [batch, seq, heads, head_dim]; the first `rotated_heads` heads of every position are
// rotated in place. cos and sin are [> max position, head_dim / 2], indexed by the token's
// position: positions[b * seq + t] when positions is given (packed examples restart at 0),
// else t. inverse = true applies the opposite rotation (the backward).
void rope_rotate(float* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t rotated_heads,
                 const float* cos, const float* sin, const int32_t* positions, bool inverse);

}  // namespace forge::cpu
