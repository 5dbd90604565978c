// Where the grouped expert casts (NOTE [FP8 grouped expert casts] in
// kernels/cuda/fp8_grouped_cast.cu) put each group's codes, and how large their buffer is:
// plain host and device arithmetic, so that the FP8 projections size the buffer from the
// same formula the kernels write by (as kernels/cuda/fp8_epilogue.h, host-safe).
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace forge::cuda {

// Where fp8_grouped_cast writes group g's codes (its first row `begin`, `cols` wide) in its
// output: the group's place in the input rounded up to a 256-byte boundary after g x 256
// bytes of room, so every group's codes start where cuBLASLt's FP8 GEMMs assume operands
// start (its default minimum alignment) and no two groups overlap. The output needs
// fp8_grouped_codes_bytes(rows, cols, groups) bytes.
constexpr int64_t kFp8GroupAlignment = 256;
FORGE_HOST_DEVICE constexpr int64_t fp8_grouped_codes_at(int64_t begin, int64_t cols, int64_t g) {
  return (begin * cols + g * kFp8GroupAlignment + kFp8GroupAlignment - 1) / kFp8GroupAlignment * kFp8GroupAlignment;
}
constexpr int64_t fp8_grouped_codes_bytes(int64_t rows, int64_t cols, int64_t groups) {
  return rows * cols + (groups + 1) * kFp8GroupAlignment;
}

}  // namespace forge::cuda
