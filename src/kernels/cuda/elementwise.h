#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

void add_inplace(bf16* a, const bf16* b, int64_t n);
void add_inplace(float* a, const float* b, int64_t n);
void add(bf16* out, const bf16* a, const bf16* b, int64_t n);
void scale_inplace(float* a, float s, int64_t n);
// Sum of squares of n fp32 values, accumulated in fp64 in a fixed order (deterministic).
double sum_of_squares(const float* a, int64_t n);
void cast(bf16* out, const float* in, int64_t n);
void cast(float* out, const bf16* in, int64_t n);

}  // namespace forge::cuda
