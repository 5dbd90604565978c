#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// out[i] = normal number offset + i of the stream `seed`, i < n (NOTE [Counter-based
// normals] in kernels/philox.h), rounded to nearest for bf16.
void random_normal(float* out, int64_t n, uint64_t seed, uint64_t offset);
void random_normal(bf16* out, int64_t n, uint64_t seed, uint64_t offset);

}  // namespace forge::cuda
