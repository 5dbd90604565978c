#pragma once

#include <cstdint>

#include "core/device.h"

namespace forge::cuda {

// NF4 codes with double-quantized absmax (NOTE [NF4 storage] in ops/nf4.h) straight to FP8,
// as nf4_dequantize to bf16 followed by fp8_amax / fp8_cast would do (NOTE [FP8 straight
// from NF4] in ops/nf4_fp8.h).
// amax[0] = max(amax[0], max |w[i]|) over the n dequantized bf16 weights (NaN winning); not
// zeroed first, so several parts fold into one amax.
void nf4_fp8_amax(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales, float absmax_offset,
                  int64_t n, float* amax, CudaStream stream = nullptr);
// out[i] = E4M3 cast_saturated(w[i] * scale[0]) of the dequantized bf16 weights; with amax
// not null, max |w[i]| is folded into amax[0] as above.
void nf4_fp8_cast(const uint8_t* codes, const uint8_t* absmax_codes, const float* absmax_scales, float absmax_offset,
                  int64_t n, const float* scale, uint8_t* out, float* amax, CudaStream stream = nullptr);

}  // namespace forge::cuda
