// NOTE [Stochastic rounding to bf16]
// Weights held only in bf16 (optimizer.master_dtype bf16, NOTE [bf16 master weights] in
// optim/optimizer.h) lose an update smaller than half an ulp if it is rounded to nearest:
// a weight of 1.0 has an ulp of 2^-7, and an AdamW step of lr 1e-5 never moves it. Rounded
// stochastically, the fp32 result x between the neighbouring bf16 values lo < x < hi becomes
// hi with probability (x - lo) / (hi - lo) and lo otherwise, so the expected weight is the
// fp32 one and small steps add up over many steps (Gupta et al. 2015; Zamirai et al.,
// "Revisiting BFloat16 Training", 2020; torchao's AdamW with bf16_stochastic_round=True).
//
// The rounding is the one torchao uses: add 16 random bits to the low half of x's fp32
// bit pattern and keep the high half. A carry out of the low half moves the magnitude up by
// one bf16 ulp, with probability (low half) / 2^16 = (|x| - |lo|) / ulp: away from zero
// for either sign, across an exponent boundary as well (the carry runs into the exponent).
// inf and NaN are returned as rounding to nearest returns them; a finite x that would
// carry into inf stays at the largest finite bf16 of its sign.
//
// The random bits are a pure function of (seed, step, flat index): word (index mod 4) of
// Philox4x32-10 (NOTE [Counter-based normals] in kernels/philox.h) of the counter
// (index / 4, step) under the key seed, its low 16 bits. Any thread, on any device, rounds
// element `index` of step `step` the same way, so the CUDA kernel and the CPU reference
// agree bit for bit, and a run resumed at step s rounds as the uninterrupted run does.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/philox.h"

#if defined(__CUDACC__)
#define FORGE_SR_FN __host__ __device__ __forceinline__
#else
#define FORGE_SR_FN inline
#endif

namespace forge::stochastic_rounding {

// The four random 16-bit values of elements 4 block .. 4 block + 3 at `step` (in w[0..3]).
FORGE_SR_FN philox::Words bits4(uint64_t seed, uint64_t step, uint64_t block) {
  return philox::philox4x32_10(philox::Words{{static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32),
                                              static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32)}},
                               static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// The random 16 bits of element `index` at `step`.
FORGE_SR_FN uint32_t bits(uint64_t seed, uint64_t step, uint64_t index) {
  return bits4(seed, step, index / 4).w[index % 4] & 0xFFFFu;
}

// x rounded to a bf16 bit pattern with the random 16 bits `random16` (< 2^16).
FORGE_SR_FN uint16_t round_bits(float x, uint32_t random16) {
  uint32_t u;
#if defined(__CUDA_ARCH__)
  u = __float_as_uint(x);
#else
  std::memcpy(&u, &x, sizeof u);
#endif
  if ((u & 0x7F800000u) == 0x7F800000u) {                        // inf or NaN: as to nearest
    if (u & 0x007FFFFFu) return static_cast<uint16_t>((u >> 16) | 0x40u);  // a quiet NaN
    return static_cast<uint16_t>(u >> 16);
  }
  const uint32_t sum = u + (random16 & 0xFFFFu);
  uint16_t out = static_cast<uint16_t>(sum >> 16);
  if ((out & 0x7F80u) == 0x7F80u) out = static_cast<uint16_t>((out & 0x8000u) | 0x7F7Fu);  // no carry into inf
  return out;
}

}  // namespace forge::stochastic_rounding

#undef FORGE_SR_FN
