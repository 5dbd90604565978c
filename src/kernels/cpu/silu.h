#pragma once

#include <cstdint>

namespace forge::cpu {

// out, in, din, dout hold n elements each; the backward overwrites din.
void silu_forward(float* out, const float* in, int64_t n);
void silu_backward(float* din, const float* dout, const float* in, int64_t n);

}  // namespace forge::cpu
