// bfloat16 on the host: the storage type of BF16 tensors outside kernels, and the
// round-to-nearest-even conversions the tests and weight casts use. Kernels use CUDA's
// __nv_bfloat16, which has the same bit layout.
#pragma once

#include <cstdint>
#include <cstring>

#include "core/dtype.h"

namespace forge {

struct BFloat16 {
  uint16_t bits = 0;
};

inline BFloat16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return BFloat16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return BFloat16{static_cast<uint16_t>(u >> 16)};
}

inline float to_float(BFloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <> constexpr DType dtype_of<BFloat16>() { return DType::BF16; }

}  // namespace forge
