#pragma once

#include <cstdint>

namespace forge::cpu {

// probs, scores [rows, cols] (ops/row_softmax.h); probs may be scores.
void row_softmax(float* probs, const float* scores, int64_t rows, int64_t cols);

}  // namespace forge::cpu
