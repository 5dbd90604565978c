#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// Sum of squares of n fp32 values, accumulated in fp64 in a fixed order (deterministic).
double sum_of_squares(const float* a, int64_t n);
// out[i] = in[i] converted, enqueued on `stream`.
void cast(bf16* out, const float* in, int64_t n, cudaStream_t stream = nullptr);
void cast(float* out, const bf16* in, int64_t n, cudaStream_t stream = nullptr);
// dst[i] += src[i], enqueued on `stream`.
void accumulate(float* dst, const float* src, int64_t n, cudaStream_t stream);
void accumulate(float* dst, const bf16* src, int64_t n, cudaStream_t stream);
// dst[i] = bf16(float(dst[i]) + float(src[i])), enqueued on `stream`.
void accumulate(bf16* dst, const bf16* src, int64_t n, cudaStream_t stream);

}  // namespace forge::cuda
