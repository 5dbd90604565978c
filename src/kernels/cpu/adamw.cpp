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
//
// A bf16 param (NOTE [bf16 master weights] in optim/optimizer.h) is widened, takes the same
// fp32 update and is rounded stochastically (NOTE [Stochastic rounding to bf16]); the
// random bits depend on the element's flat index only, so the split into threads does not
// change them either.
#include "kernels/cpu/adamw.h"

#include <cmath>

#include "core/bf16.h"
#include "core/parallel.h"
#include "kernels/stochastic_rounding.h"

namespace forge::cpu {
namespace {

float lerp(float from, float to, float weight) {
  if (std::fabs(weight) < 0.5f) return std::fma(weight, to - from, from);
  return std::fma(weight - 1.0f, to - from, to);
}

// One element's update: m, v in place; returns the new param.
float adamw_element(float p, float g, float& m, float& v, const AdamWScalars& s) {
  const float gi = g * s.grad_scale;
  float decayed = p * s.decay_factor;
  float m_new = lerp(m, gi, s.one_minus_beta1);
  float v_new = std::fma(s.one_minus_beta2 * gi, gi, v * s.beta2);
  float denom = std::sqrt(v_new) / s.bias_correction2_sqrt + s.eps;
  m = m_new;
  v = v_new;
  return decayed + (s.neg_step_size * m_new) / denom;
}

}  // namespace

void adamw_update_bf16_param(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                             const AdamWScalars& s, const AdamWRounding& rounding) {
  BFloat16* p = param.data<BFloat16>();
  const float* g = grad.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  parallel_for(param.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float updated = adamw_element(to_float(p[i]), g[i], pm[i], pv[i], s);
      const uint32_t r = stochastic_rounding::bits(rounding.seed, rounding.step, rounding.offset + static_cast<uint64_t>(i));
      p[i] = BFloat16{stochastic_rounding::round_bits(updated, r)};
    }
  });
}

void adamw_update(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v, const AdamWScalars& s) {
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  parallel_for(param.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) p[i] = adamw_element(p[i], g[i], pm[i], pv[i], s);
  });
}

}  // namespace forge::cpu
