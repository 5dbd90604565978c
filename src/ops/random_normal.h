// Standard normal numbers from a counter-based generator (Philox4x32-10, then Box-Muller),
// so that a run's noise depends only on (seed, offset), never on the device, the launch
// shape or what ran before: element i of `out` is normal number offset + i of the stream
// `seed`. The CPU and CUDA produce the same numbers up to the last bits of their log/sin/cos
// (then rounded to bf16 on CUDA where `out` is bf16). What rectified-flow training draws its
// noise from, on the GPU, without a host round trip.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

void random_normal(const Tensor& out, uint64_t seed, uint64_t offset);

}  // namespace forge
