#pragma once

#include <cstdint>

namespace forge::cpu {

// y, dy [rows, features]; bias, grad [features].
void add_bias(float* y, const float* bias, int64_t rows, int64_t features);
// grad = column sums of dy (overwrite) or grad += them.
void bias_gradient(float* grad, const float* dy, int64_t rows, int64_t features, bool overwrite);

}  // namespace forge::cpu
