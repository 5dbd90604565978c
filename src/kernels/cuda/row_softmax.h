#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// probs bf16 [rows, cols] = softmax of each row of scores fp32 [rows, cols] (ops/row_softmax.h).
void row_softmax(bf16* probs, const float* scores, int64_t rows, int64_t cols);

}  // namespace forge::cuda
