#pragma once

#include <cstdint>

namespace forge::cpu {

// x, y, dx, dy are [rows, dim]; weight, dweight are [dim]; rstd is [rows].
void rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight, int64_t rows, int64_t dim, float eps);
// Accumulates: dx += d(loss)/dx, dweight += d(loss)/dweight.
void rmsnorm_backward(float* dx, float* dweight, const float* dy, const float* x, const float* weight,
                      const float* rstd, int64_t rows, int64_t dim);

}  // namespace forge::cpu
