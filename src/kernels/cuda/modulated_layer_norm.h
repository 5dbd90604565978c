#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// x, y, dx, dy are bf16 [batch, tokens, dim]; shift, scale, dshift, dscale bf16 [batch, dim];
// mean and rstd fp32 [batch, tokens]. dim must be a multiple of 8 and every pointer 16-byte
// aligned.
void modulated_layer_norm_forward(bf16* y, float* mean, float* rstd, const bf16* x, const bf16* shift,
                                  const bf16* scale, int64_t batch, int64_t tokens, int64_t dim, float eps);
// Accumulates dx += d(loss)/dx; overwrites dshift and dscale (sums over tokens in fp32,
// rounded once, in a fixed order: deterministic).
void modulated_layer_norm_backward(bf16* dx, bf16* dshift, bf16* dscale, const bf16* dy, const bf16* x,
                                   const bf16* scale, const float* mean, const float* rstd, int64_t batch,
                                   int64_t tokens, int64_t dim);

}  // namespace forge::cuda
