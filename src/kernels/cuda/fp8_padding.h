#pragma once

#include <cstdint>

namespace forge::cuda {

// out [rows, padded_cols] = codes [rows, cols] with zero bytes in columns [cols,
// padded_cols): FP8 codes whose contraction runs over a multiple of 16 (NOTE [FP8 padded
// token contraction] in ops/fp8_linear.h). Enqueued on the current stream; in and out must
// not overlap.
void fp8_pad_columns(const uint8_t* codes, int64_t rows, int64_t cols, int64_t padded_cols, uint8_t* out);

}  // namespace forge::cuda
