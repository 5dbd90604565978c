#pragma once

#include <cstdint>

namespace forge::cpu {

// x and y are [rows, dim] (y may be x); weight and bias are [dim].
void layer_norm_forward(float* y, const float* x, const float* weight, const float* bias, int64_t rows, int64_t dim,
                        float eps);

}  // namespace forge::cpu
