#pragma once

#include <cstdint>

namespace forge::cpu {

// out, in, din, dout hold n elements each; the backward overwrites din.
void gelu_tanh_forward(float* out, const float* in, int64_t n);
void gelu_tanh_backward(float* din, const float* dout, const float* in, int64_t n);
// Forward only; out may be in.
void gelu_erf_forward(float* out, const float* in, int64_t n);
void quick_gelu_forward(float* out, const float* in, int64_t n);

}  // namespace forge::cpu
