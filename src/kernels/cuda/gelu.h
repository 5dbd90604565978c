#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// out, in, din, dout bf16 with n elements each (any alignment); the backward overwrites din.
void gelu_tanh_forward(bf16* out, const bf16* in, int64_t n);
void gelu_tanh_backward(bf16* din, const bf16* dout, const bf16* in, int64_t n);
// Forward only, the same layout rules; out may be in.
void gelu_erf_forward(bf16* out, const bf16* in, int64_t n);
void quick_gelu_forward(bf16* out, const bf16* in, int64_t n);

}  // namespace forge::cuda
