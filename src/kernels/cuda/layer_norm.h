#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// x and y bf16 [rows, dim] (y may be x); weight and bias bf16 [dim]. dim must be a multiple
// of 8 and every pointer 16-byte aligned.
void layer_norm_forward(bf16* y, const bf16* x, const bf16* weight, const bf16* bias, int64_t rows, int64_t dim,
                        float eps);

}  // namespace forge::cuda
