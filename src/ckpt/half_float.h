// Conversions between fp32 and the two 16-bit float formats model files use.
//
// bf16 is the top half of an fp32: widening is a shift, narrowing rounds to nearest with
// ties to even (as PyTorch's .to(torch.bfloat16)), keeping NaNs NaN. fp16 (IEEE binary16)
// has its own exponent bias and subnormals, so widening rebuilds the fp32 bit pattern
// field by field, and narrowing rounds to nearest with ties to even as PyTorch's .half()
// does: magnitudes from 65520 up become infinity, those below 2^-14 subnormals.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace forge {

inline float bf16_to_float(uint16_t bits) {
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  uint32_t rounding_bias = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float f16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1fu;
  const uint32_t mantissa = bits & 0x3ffu;
  uint32_t u;
  if (exponent == 0) {
    float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // zero or subnormal
    std::memcpy(&u, &magnitude, sizeof(u));
    u |= sign;
  } else if (exponent == 0x1f) {
    u = sign | 0x7f800000u | (mantissa << 13);  // inf or NaN
  } else {
    u = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
  }
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;      // NaN stays a (quiet) NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;     // >= 65520 (or inf): infinity
  if (magnitude >= 0x38800000u) {                          // normal: rebias 127 -> 15, round 13 bits away
    uint32_t h = magnitude - 0x38000000u;
    h += 0x0fffu + ((h >> 13) & 1u);
    return static_cast<uint16_t>(sign | (h >> 13));
  }
  // Subnormal or zero: the value in units of 2^-24, rounded to nearest even (the scaling
  // by a power of two is exact; 1024 units is the smallest normal, encoded the same way).
  float units = std::nearbyint(std::ldexp(std::fabs(f), 24));
  return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
}

}  // namespace forge
