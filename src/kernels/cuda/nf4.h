#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// NF4 codes (two a byte, element 2i in the high nibble) with double-quantized absmax
// (absmax_codes [ceil(n / 64)] u8, absmax_scales [ceil(blocks / 256)] fp32, offset) into
// out bf16 [n] (NOTE [NF4 storage] in ops/nf4.h).
void nf4_dequantize(bf16* out, const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales,
                    float absmax_offset, int64_t n);

}  // namespace forge::cuda
