#pragma once

#include <cstdint>

namespace forge::cpu {

// x, y, dx, dy are [batch, tokens, dim]; shift, scale, dshift, dscale are [batch, dim];
// mean and rstd are [batch, tokens].
void modulated_layer_norm_forward(float* y, float* mean, float* rstd, const float* x, const float* shift,
                                  const float* scale, int64_t batch, int64_t tokens, int64_t dim, float eps);
// Accumulates dx += d(loss)/dx; overwrites dshift and dscale.
void modulated_layer_norm_backward(float* dx, float* dshift, float* dscale, const float* dy, const float* x,
                                   const float* scale, const float* mean, const float* rstd, int64_t batch,
                                   int64_t tokens, int64_t dim);

}  // namespace forge::cpu
