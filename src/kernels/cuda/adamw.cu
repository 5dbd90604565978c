// AdamW on the GPU: one pass over the fp32 master weights, gradient and both moments,
// with the same arithmetic (operation order, fused multiply-adds, lerp form) as the CPU
// kernel, which itself follows torch.optim.AdamW. The same pass applies the global-norm
// clip coefficient to the gradient as it is loaded and, when asked, writes the bf16
// compute copy of the updated weights (NOTE [Clipping and the bf16 copy inside AdamW]),
// so neither needs a pass of its own.
//
// Memory-bound: per element it reads param, grad, m, v and writes param, m, v (+ the bf16
// copy): 28 bytes with fp32 moments, 20 with bf16 moments, vectorized by 4: each thread
// moves its four elements of every tensor in one access (16 bytes of fp32, 8 of bf16). With bf16
// moments (NOTE [Optimizer state in bf16]) the update is computed in fp32 from the
// widened moments and the new moments are rounded to nearest on store.
//
// A bf16 param (NOTE [bf16 master weights] in optim/optimizer.h: no fp32 master) is read as
// four bf16 values, updated in fp32 by the same arithmetic and stored rounded
// stochastically (NOTE [Stochastic rounding to bf16] in kernels/stochastic_rounding.h):
// 16 (fp32 moments) or 12 bytes (bf16 moments) per element. Its random bits cost one
// Philox4x32-10 call per four elements (ten rounds of two 32-bit multiplies), integer work
// well within what a memory-bound pass leaves idle; a lane's four elements are one Philox
// block when the call's flat offset is a multiple of four, else each element draws its own.
#include "kernels/cuda/adamw.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/stochastic_rounding.h"

namespace forge::cuda {
namespace {

__device__ float lerp(float from, float to, float weight) {
  if (fabsf(weight) < 0.5f) return fmaf(weight, to - from, from);
  return fmaf(weight - 1.0f, to - from, to);
}

__device__ float widen(float x) { return x; }
__device__ float widen(bf16 x) { return __bfloat162float(x); }
template <typename T>
__device__ T narrow(float x);
template <>
__device__ float narrow<float>(float x) { return x; }
template <>
__device__ bf16 narrow<bf16>(float x) { return __float2bfloat16_rn(x); }

// Four moments in one 16-byte (fp32) or 8-byte (bf16) access: the vectorized path's
// pointers are aligned to four elements.
__device__ __forceinline__ void load4(float* out, const float* from) {
  const float4 x = *reinterpret_cast<const float4*>(from);
  out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
}
__device__ __forceinline__ void store4(float* to, const float* in) {
  *reinterpret_cast<float4*>(to) = make_float4(in[0], in[1], in[2], in[3]);
}
__device__ __forceinline__ void load4(bf16* out, const bf16* from) {
  const uint2 x = *reinterpret_cast<const uint2*>(from);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&x.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&x.y);
  out[0] = lo.x, out[1] = lo.y, out[2] = hi.x, out[3] = hi.y;
}
__device__ __forceinline__ void store4(bf16* to, const bf16* in) {
  __nv_bfloat162 lo, hi;
  lo.x = in[0], lo.y = in[1], hi.x = in[2], hi.y = in[3];
  uint2 x;
  x.x = *reinterpret_cast<const uint32_t*>(&lo);
  x.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(to) = x;
}

template <typename Moment>
__device__ float adamw_element(float& p, float grad, Moment& m, Moment& v, const AdamWScalars& s) {
  float g = __fmul_rn(grad, s.grad_scale);
  float decayed = __fmul_rn(p, s.decay_factor);
  float m_new = lerp(widen(m), g, s.one_minus_beta1);
  float v_new = fmaf(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(widen(v), s.beta2));
  float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v_new), s.bias_correction2_sqrt), s.eps);
  m = narrow<Moment>(m_new);
  v = narrow<Moment>(v_new);
  p = __fadd_rn(decayed, __fdiv_rn(__fmul_rn(s.neg_step_size, m_new), denom));
  return p;
}

template <typename Moment>
__global__ void adamw_kernel(float* param, const float* grad, Moment* m, Moment* v, bf16* copy, int64_t n,
                             AdamWScalars s) {
  int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= n) return;
  bool aligned = ((reinterpret_cast<uintptr_t>(param + i) | reinterpret_cast<uintptr_t>(grad + i)) % 16) == 0 &&
                 ((reinterpret_cast<uintptr_t>(m + i) | reinterpret_cast<uintptr_t>(v + i)) % (4 * sizeof(Moment))) == 0 &&
                 (!copy || reinterpret_cast<uintptr_t>(copy + i) % 8 == 0);
  if (i + 4 <= n && aligned) {
    float4 p = *reinterpret_cast<float4*>(param + i), g = *reinterpret_cast<const float4*>(grad + i);
    Moment mm[4], vv[4];
    load4(mm, m + i);
    load4(vv, v + i);
    adamw_element(p.x, g.x, mm[0], vv[0], s);
    adamw_element(p.y, g.y, mm[1], vv[1], s);
    adamw_element(p.z, g.z, mm[2], vv[2], s);
    adamw_element(p.w, g.w, mm[3], vv[3], s);
    *reinterpret_cast<float4*>(param + i) = p;
    store4(m + i, mm);
    store4(v + i, vv);
    if (copy) {
      __nv_bfloat162 lo = __floats2bfloat162_rn(p.x, p.y), hi = __floats2bfloat162_rn(p.z, p.w);
      reinterpret_cast<__nv_bfloat162*>(copy + i)[0] = lo;
      reinterpret_cast<__nv_bfloat162*>(copy + i)[1] = hi;
    }
    return;
  }
  for (int64_t k = i; k < min(n, i + 4); ++k) {
    float p = adamw_element(param[k], grad[k], m[k], v[k], s);
    if (copy) copy[k] = __float2bfloat16(p);
  }
}

// Four bf16 params in one 8-byte access, as fp32.
__device__ __forceinline__ void load4_bf16_as_float(float* out, const bf16* from) {
  bf16 b[4];
  load4(b, from);
  for (int k = 0; k < 4; ++k) out[k] = __bfloat162float(b[k]);
}

template <typename Moment>
__global__ void adamw_bf16_param_kernel(bf16* param, const float* grad, Moment* m, Moment* v, int64_t n,
                                        AdamWScalars s, AdamWRounding r) {
  int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 4;
  if (i >= n) return;
  const uint64_t first = r.offset + static_cast<uint64_t>(i);
  bool aligned = ((reinterpret_cast<uintptr_t>(param + i) | reinterpret_cast<uintptr_t>(m + i) |
                   reinterpret_cast<uintptr_t>(v + i)) % (4 * sizeof(Moment))) == 0 &&
                 reinterpret_cast<uintptr_t>(param + i) % 8 == 0 && reinterpret_cast<uintptr_t>(grad + i) % 16 == 0;
  if (i + 4 <= n && aligned && first % 4 == 0) {
    float p[4];
    load4_bf16_as_float(p, param + i);
    const float4 g4 = *reinterpret_cast<const float4*>(grad + i);
    const float g[4] = {g4.x, g4.y, g4.z, g4.w};
    Moment mm[4], vv[4];
    load4(mm, m + i);
    load4(vv, v + i);
    const philox::Words bits = stochastic_rounding::bits4(r.seed, r.step, first / 4);
    bf16 out[4];
    for (int k = 0; k < 4; ++k) {
      adamw_element(p[k], g[k], mm[k], vv[k], s);
      out[k] = __ushort_as_bfloat16(stochastic_rounding::round_bits(p[k], bits.w[k] & 0xFFFFu));
    }
    store4(m + i, mm);
    store4(v + i, vv);
    store4(param + i, out);
    return;
  }
  for (int64_t k = i; k < min(n, i + 4); ++k) {
    float p = __bfloat162float(param[k]);
    adamw_element(p, grad[k], m[k], v[k], s);
    const uint32_t bits = stochastic_rounding::bits(r.seed, r.step, r.offset + static_cast<uint64_t>(k));
    param[k] = __ushort_as_bfloat16(stochastic_rounding::round_bits(p, bits));
  }
}

}  // namespace

void adamw_update_bf16_param(void* param, const float* grad, void* m, void* v, bool bf16_moments, int64_t n,
                             const AdamWScalars& s, const AdamWRounding& rounding) {
  int64_t threads = (n + 3) / 4;
  if (threads == 0) return;
  unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  bf16* p = static_cast<bf16*>(param);
  if (bf16_moments)
    adamw_bf16_param_kernel<<<blocks, 256>>>(p, grad, static_cast<bf16*>(m), static_cast<bf16*>(v), n, s, rounding);
  else
    adamw_bf16_param_kernel<<<blocks, 256>>>(p, grad, static_cast<float*>(m), static_cast<float*>(v), n, s,
                                             rounding);
  FORGE_CUDA_LAUNCH_CHECK();
}

void adamw_update(float* param, const float* grad, void* m, void* v, bool bf16_moments, void* compute_copy,
                  int64_t n, const AdamWScalars& s) {
  int64_t threads = (n + 3) / 4;
  if (threads == 0) return;
  unsigned blocks = static_cast<unsigned>((threads + 255) / 256);
  bf16* copy = static_cast<bf16*>(compute_copy);
  if (bf16_moments)
    adamw_kernel<<<blocks, 256>>>(param, grad, static_cast<bf16*>(m), static_cast<bf16*>(v), copy, n, s);
  else
    adamw_kernel<<<blocks, 256>>>(param, grad, static_cast<float*>(m), static_cast<float*>(v), copy, n, s);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
