// GELU in its tanh approximation, elementwise:
//   out = 0.5 x (1 + tanh u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   din = dout (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx),  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// tanh saturates to +-1 for large |u| (no overflow), which is the right limit for both.
// Chunks of elements are split across threads.
// The exact GELU, 0.5 x (1 + erf(x / sqrt 2)), and CLIP's quick GELU, x sigmoid(1.702 x)
// (written x / (1 + e^(-1.702 x)): e^(-1.702 x) overflows to infinity for x below about
// -52, which gives the right limit 0, never NaN), forward only.
#include "kernels/cpu/gelu.h"

#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;
constexpr int64_t kGrain = 8192;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kQuickGeluScale = 1.702f;

}  // namespace

void gelu_tanh_forward(float* out, const float* in, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float x = in[i];
      out[i] = 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x)));
    }
  });
}

void gelu_tanh_backward(float* din, const float* dout, const float* in, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float x = in[i];
      const float th = std::tanh(kSqrt2OverPi * (x + kCubic * x * x * x));
      const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
      din[i] = dout[i] * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du);
    }
  });
}

void gelu_erf_forward(float* out, const float* in, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float x = in[i];
      out[i] = 0.5f * x * (1.0f + std::erf(x * kInvSqrt2));
    }
  });
}

void quick_gelu_forward(float* out, const float* in, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float x = in[i];
      out[i] = x / (1.0f + std::exp(-kQuickGeluScale * x));
    }
  });
}

}  // namespace forge::cpu
