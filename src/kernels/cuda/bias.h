#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// y bf16 [rows, features] += bias bf16 [features] on every row (in fp32, rounded once).
void add_bias(bf16* y, const bf16* bias, int64_t rows, int64_t features);
// grad fp32 [features] = (or +=, without `overwrite`) the column sums of dy bf16 [rows,
// features], deterministically.
void bias_gradient(float* grad, const bf16* dy, int64_t rows, int64_t features, bool overwrite);

}  // namespace forge::cuda
