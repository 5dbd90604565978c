#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// x, y, dx, dy bf16 [batch, tokens, dim]; gate, dgate bf16 [batch, dim]. dim must be a
// multiple of 8 and every pointer 16-byte aligned.
// Forward: out = x + gate * y, out shaped like x (out may be x: in place).
void gated_residual_forward(bf16* out, const bf16* x, const bf16* y, const bf16* gate, int64_t batch, int64_t tokens,
                            int64_t dim);
// Overwrites dy = gate * dx and dgate = sum_t dx y (fp32 sums, rounded once, in a fixed
// order: deterministic).
void gated_residual_backward(bf16* dy, bf16* dgate, const bf16* dx, const bf16* y, const bf16* gate, int64_t batch,
                             int64_t tokens, int64_t dim);

}  // namespace forge::cuda
