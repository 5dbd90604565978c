// SiLU, elementwise: out = x s, s = sigmoid(x) = 1 / (1 + exp(-x)), din = dout s (1 + x (1 - s)).
// For very negative x, exp(-x) overflows to inf and s becomes exactly 0, the right limit of
// both (as in kernels/cpu/swiglu.cpp). Chunks of elements are split across threads.
#include "kernels/cpu/silu.h"

#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

constexpr int64_t kGrain = 8192;

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace

void silu_forward(float* out, const float* in, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = in[i] * sigmoid(in[i]);
  });
}

void silu_backward(float* din, const float* dout, const float* in, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float s = sigmoid(in[i]);
      din[i] = dout[i] * s * (1.0f + in[i] * (1.0f - s));
    }
  });
}

}  // namespace forge::cpu
