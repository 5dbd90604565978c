#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// The most adapted modules one fused projection has (q, k, v).
inline constexpr int kMaxLoraBlocks = 4;

// bf16 out[i] = (accumulate ? out[i] : 0) + (kept ? in[i] / (1 - p) : 0), i < n; the
// mask of kernels/lora_dropout_mask.h.
void lora_dropout(bf16* out, const bf16* in, int64_t n, float p, uint64_t seed, bool accumulate);
// fp32 b [rows, blocks * rank]: zeroes what lies outside each column block's rows.
void lora_mask_blocks(float* b, int64_t rows, int64_t rank, int blocks, const int64_t* row_begin,
                      const int64_t* row_end);

}  // namespace forge::cuda
