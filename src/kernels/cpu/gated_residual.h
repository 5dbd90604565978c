#pragma once

#include <cstdint>

namespace forge::cpu {

// x, y, dx, dy are [batch, tokens, dim]; gate and dgate are [batch, dim].
// Forward: out = x + gate * y (out and x shaped alike; out may be x: in place). Backward:
// overwrites dy = gate * dx and dgate = sum_t dx y.
void gated_residual_forward(float* out, const float* x, const float* y, const float* gate, int64_t batch,
                            int64_t tokens, int64_t dim);
void gated_residual_backward(float* dy, float* dgate, const float* dx, const float* y, const float* gate,
                             int64_t batch, int64_t tokens, int64_t dim);

}  // namespace forge::cpu
