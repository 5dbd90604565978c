// AdamW on the CPU: one pass over the fp32 master weights, updating the two moment
// buffers and the parameter in place. Every element is independent, so parallel_for
// splits the range freely and the result does not depend on the thread count.
//
// The arithmetic mirrors torch's single-tensor AdamW on a vectorized CPU build, element
// by element (NOTE [AdamW arithmetic as torch does it]), after the clip coefficient
// (NOTE [Clipping and the bf16 copy inside AdamW]):
//   g     = grad * grad_scale                                  (clip_grad_norm_'s mul_)
//   param = param * decay_factor                               (param.mul_)
//   m     = lerp(m, g, 1 - beta1)                              (exp_avg.lerp_, fused as
//           ATen's vectorized lerp is: small weights step from m, large ones from g)
//   v     = fma((1 - beta2) * g, g, v * beta2)                 (mul_ then addcmul_, which
//           ATen vectorizes as a fused multiply-add)
//   denom = sqrt(v) / bias_correction2_sqrt + eps
//   param = param + (neg_step_size * m) / denom                (addcdiv_)
// Each line rounds to fp32 where torch does. The one op left apart is sqrt: forge's is
// correctly rounded, torch's CPU build (MKL VML) is off by an ulp for a few in a thousand
// inputs, so the two agree to a few ulps after many steps rather than bit for bit.
#include "kernels/cpu/adamw.h"

#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {
namespace {

float lerp(float from, float to, float weight) {
  if (std::fabs(weight) < 0.5f) return std::fma(weight, to - from, from);
  return std::fma(weight - 1.0f, to - from, to);
}

}  // namespace

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWScalars& s) {
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  parallel_for(param.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float gi = g[i] * s.grad_scale;
      float decayed = p[i] * s.decay_factor;
      float m_new = lerp(pm[i], gi, s.one_minus_beta1);
      float v_new = std::fma(s.one_minus_beta2 * gi, gi, pv[i] * s.beta2);
      float denom = std::sqrt(v_new) / s.bias_correction2_sqrt + s.eps;
      pm[i] = m_new;
      pv[i] = v_new;
      p[i] = decayed + (s.neg_step_size * m_new) / denom;
    }
  });
}

}  // namespace forge::cpu
