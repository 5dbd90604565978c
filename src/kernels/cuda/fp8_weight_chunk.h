// CUDA side of ops/fp8_weight_chunk.h: an FSDP rank's fp32 master chunk of an FP8 weight
// cast to E4M3 codes as the bf16-gather path casts the gathered bf16 weight, and the byte
// transpose of gathered codes (NOTE [FP8 all-gather] in distributed/fsdp.h).
#pragma once

#include <cstdint>

#include "core/device.h"

namespace forge::cuda {

// amax[0] = max |bf16(x[i])| over fp32 x[n], the values rounded to bf16 first (NaN if one
// is NaN; 0 for n = 0); written over, on `stream`.
void fp8_chunk_amax(const float* x, int64_t n, float* amax, CudaStream stream);
// For k < count: scale[k * stride] = torchao's amax_to_scale(amax[k]) for E4M3 and
// scale_inv[k * stride] = 1 / it, the same bits as fp8_scale_from_amax.
void fp8_chunk_scales(const float* amax, int64_t count, float* scale, float* scale_inv, int64_t stride,
                      CudaStream stream);
// out[i] = E4M3 cast_saturated(bf16(x[i]) * scale[0]): fp8_cast's codes for the bf16 copy
// of x. With amax not null, max |bf16(x[i])| is folded into amax[0] (NaN winning).
void fp8_chunk_cast(const float* x, int64_t n, const float* scale, uint8_t* out, float* amax, CudaStream stream);
// seen[0] = max(seen[0], amax[0]), NaN winning: a gathered weight's amax folded into its
// projection's record where a cast would have folded it.
void fp8_fold_amax(const float* amax, float* seen, CudaStream stream);
// out [cols, rows] = the transpose of the bytes in [rows, cols].
void fp8_transpose_codes(const uint8_t* in, int64_t rows, int64_t cols, uint8_t* out, CudaStream stream);

}  // namespace forge::cuda
