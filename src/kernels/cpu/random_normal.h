#pragma once

#include <cstdint>

namespace forge::cpu {

// out[i] = normal number offset + i of the stream `seed`, i < n (NOTE [Counter-based
// normals] in kernels/philox.h).
void random_normal(float* out, int64_t n, uint64_t seed, uint64_t offset);

}  // namespace forge::cpu
