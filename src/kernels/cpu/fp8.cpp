// FP8 conversions on the host (NOTE [FP8 formats] in fp8.h). The cast rounds |x| on the
// format's grid: its spacing at |x| is 2^(e - mantissa_bits), e being |x|'s binary
// exponent or the format's smallest normal exponent, whichever is larger (subnormals
// share the smallest normal spacing). |x| divided by that power of two is exact in fp32,
// so one round-to-nearest-even of the quotient is the whole rounding; the rounded value
// is then encoded, or found past the largest finite and handled by the overflow rule.
#include "kernels/cpu/fp8.h"

#include <algorithm>
#include <cmath>
#include <cstring>

namespace forge::cpu {
namespace {

struct Layout {
  int mantissa_bits;
  int bias;
  uint8_t max_code;  // largest finite magnitude
  uint8_t overflow_code;  // what the plain cast gives past it: NaN (E4M3) or inf (E5M2)
};

constexpr Layout layout(Fp8Format format) {
  return format == Fp8Format::E4M3 ? Layout{3, 7, 0x7e, 0x7f} : Layout{2, 15, 0x7b, 0x7c};
}

// The code of a magnitude on the format's grid, at most the largest finite.
uint8_t encode_on_grid(double v, const Layout& l) {
  if (v == 0.0) return 0;
  const int min_exponent = 1 - l.bias;
  int exponent = 0;
  std::frexp(v, &exponent);  // v = f * 2^exponent, f in [0.5, 1)
  --exponent;                // v = 1.m * 2^exponent
  if (exponent < min_exponent) return static_cast<uint8_t>(std::ldexp(v, l.mantissa_bits - min_exponent));
  const int mantissa = static_cast<int>(std::ldexp(v, l.mantissa_bits - exponent)) - (1 << l.mantissa_bits);
  return static_cast<uint8_t>(((exponent + l.bias) << l.mantissa_bits) | mantissa);
}

uint8_t convert(float x, Fp8Format format, bool saturate) {
  const Layout l = layout(format);
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80);
  if (std::isnan(x)) return sign | 0x7f;
  const float a = std::fabs(x);
  if (std::isinf(a)) return sign | (saturate ? l.max_code : l.overflow_code);
  if (a == 0.0f) return sign;
  int exponent = 0;
  std::frexp(a, &exponent);
  const int grid_exponent = std::max(exponent - 1, 1 - l.bias) - l.mantissa_bits;
  const float steps = std::nearbyint(std::ldexp(a, -grid_exponent));  // exact quotient, rounded to nearest even
  const double v = std::ldexp(static_cast<double>(steps), grid_exponent);
  if (v > static_cast<double>(fp8_max(format))) return sign | (saturate ? l.max_code : l.overflow_code);
  return sign | encode_on_grid(v, l);
}

}  // namespace

uint8_t fp8_from_float(float x, Fp8Format format) { return convert(x, format, false); }

uint8_t fp8_from_float_saturated(float x, Fp8Format format) { return convert(x, format, true); }

float fp8_to_float(uint8_t code, Fp8Format format) {
  const Layout l = layout(format);
  const int magnitude = code & 0x7f;
  const float sign = code & 0x80 ? -1.0f : 1.0f;
  const int exponent_field = magnitude >> l.mantissa_bits;
  const int mantissa = magnitude & ((1 << l.mantissa_bits) - 1);
  if (format == Fp8Format::E4M3 && magnitude == 0x7f) return std::copysign(NAN, sign);
  if (format == Fp8Format::E5M2 && exponent_field == 31) return mantissa ? std::copysign(NAN, sign) : sign * INFINITY;
  if (exponent_field == 0) return sign * std::ldexp(static_cast<float>(mantissa), 1 - l.bias - l.mantissa_bits);
  return sign * std::ldexp(static_cast<float>(mantissa + (1 << l.mantissa_bits)),
                           exponent_field - l.bias - l.mantissa_bits);
}

void fp8_from_float(const float* x, int64_t n, Fp8Format format, bool saturate, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = convert(x[i], format, saturate);
}

void fp8_to_float(const uint8_t* codes, int64_t n, Fp8Format format, float* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = fp8_to_float(codes[i], format);
}

}  // namespace forge::cpu
