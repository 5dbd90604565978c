#pragma once

#include <cstdint>

namespace forge::cpu {

// out[i] = (accumulate ? out[i] : 0) + (lora_keep(seed, i, p) ? in[i] / (1 - p) : 0), i < n.
void lora_dropout(float* out, const float* in, int64_t n, float p, uint64_t seed, bool accumulate);
// Zeroes b[o, c] ([rows, blocks * rank]) unless row_begin[c / rank] <= o < row_end[c / rank].
void lora_mask_blocks(float* b, int64_t rows, int64_t rank, int blocks, const int64_t* row_begin,
                      const int64_t* row_end);

}  // namespace forge::cpu
