// Size arithmetic on values that come from user input (config keys, file headers,
// checkpoint metadata): the product or sum, or nothing when it does not fit in int64_t.
// Signed overflow is undefined behaviour, so a size computed from a config value near
// 2^63 must go through these before it is compared, printed or allocated.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string_view>

#include "core/error.h"

namespace forge {

inline std::optional<int64_t> checked_add(int64_t a, int64_t b) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) return std::nullopt;
  return sum;
}

inline std::optional<int64_t> checked_mul(int64_t a, int64_t b) {
  int64_t product = 0;
  if (__builtin_mul_overflow(a, b, &product)) return std::nullopt;
  return product;
}

// Partial sums and products kept in optional: one overflow anywhere empties the result
// (parameter counts built up term by term).
inline std::optional<int64_t> checked_add(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a && b ? checked_add(*a, *b) : std::nullopt;
}
inline std::optional<int64_t> checked_mul(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a && b ? checked_mul(*a, *b) : std::nullopt;
}

// The product of all factors, or nothing when any partial product overflows.
inline std::optional<int64_t> checked_product(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t f : factors)
    if (__builtin_mul_overflow(product, f, &product)) return std::nullopt;
  return product;
}

// The same, throwing forge::Error "<what> overflows 64-bit integers (a × b)" on overflow:
// `what` names the key or field the size is computed from.
inline int64_t add_or_fail(int64_t a, int64_t b, std::string_view what) {
  if (auto sum = checked_add(a, b)) return *sum;
  FORGE_FAIL("{} overflows 64-bit integers ({} + {})", what, a, b);
}

inline int64_t mul_or_fail(int64_t a, int64_t b, std::string_view what) {
  if (auto product = checked_mul(a, b)) return *product;
  FORGE_FAIL("{} overflows 64-bit integers ({} × {})", what, a, b);
}

}  // namespace forge
