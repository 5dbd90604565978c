#pragma once

#include <cstdint>

namespace forge::cpu {

// x is [batch, seq, heads, head_dim]; the first `rotated_heads` heads of every position are
// rotated in place. cos and sin are [>= seq, head_dim / 2], indexed by the position in seq.
// inverse = true applies the opposite rotation (the backward).
void rope_rotate(float* x, int64_t batch, int64_t seq, int64_t heads, int64_t head_dim, int64_t rotated_heads,
                 const float* cos, const float* sin, bool inverse);

}  // namespace forge::cpu
