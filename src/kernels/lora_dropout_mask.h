// The LoRA dropout mask (NOTE [LoRA dropout] in ops/lora.h), shared by the CPU and CUDA
// kernels so both keep exactly the same elements: element i of a micro-batch's input is
// kept when 24 bits of SplitMix64(seed + i * golden) are at least p * 2^24.
#pragma once

#include <cstdint>

#include "kernels/host_device.h"

namespace forge {

FORGE_HOST_DEVICE inline uint32_t lora_dropout_threshold(float p) {
  return static_cast<uint32_t>(static_cast<double>(p) * 16777216.0);
}

FORGE_HOST_DEVICE inline bool lora_keep(uint64_t seed, int64_t i, uint32_t threshold) {
  uint64_t z = seed + (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<uint32_t>(z >> 40) >= threshold;
}

}  // namespace forge
