#pragma once

#include <cstdint>

#include "kernels/cpu/fp8.h"
#include "kernels/cuda/types.h"

namespace forge::cuda {

using cpu::Fp8Format;

// Every function here only enqueues work on the current stream: the amax, scale and
// inverse scale stay in device memory (fp32, one value each), nothing synchronizes the host.

// amax[0] = max |x[i]| over bf16 x[n] (NaN if an element is NaN; 0 for n = 0).
void fp8_amax(const bf16* x, int64_t n, float* amax);
// amax[0] = 0, before kernels fold an amax into it (fp8_cast's, an Fp8Epilogue's).
void fp8_amax_reset(float* amax);

// scale[0] = torchao's amax_to_scale(amax[0]) (NOTE [FP8 scaling recipes] in
// kernels/cpu/fp8_scaling.h) and scale_inv[0] = 1 / scale[0], the GEMM's dequantization factor.
// With seen not null, amax[0] is also folded into seen[0] (seen[0] = max(seen[0], amax[0]),
// NaN winning): a projection's running maximum over the step (NOTE [FP8 projection statistics]
// in kernels/cpu/fp8_scaling.h).
void fp8_scale_from_amax(const float* amax, Fp8Format format, bool power_of_2, float* scale, float* scale_inv,
                         float* seen = nullptr);

// out[i] = cast_saturated(x[i] * scale[0]). With amax not null, max |x[i]| of the same input,
// from the same pass, is folded into amax[0] (amax[0] = max(amax[0], max |x[i]|), NaN
// winning; zero it first for the amax of x alone): delayed scaling records a step's amax so.
void fp8_cast(const bf16* x, int64_t n, const float* scale, Fp8Format format, uint8_t* out, float* amax);

// x [rows, cols] row-major cast as fp8_cast into out [rows, cols] and its transpose
// out_t [cols, rows], in one read of x; either output may be null. The transpose is what a
// Hopper FP8 GEMM needs when the other major-ness is asked for (NOTE [FP8 GEMM layout] in
// kernels/cuda/fp8_matmul.h). amax as fp8_cast.
void fp8_cast_transpose(const bf16* x, int64_t rows, int64_t cols, const float* scale, Fp8Format format,
                        uint8_t* out, uint8_t* out_t, float* amax);

}  // namespace forge::cuda
