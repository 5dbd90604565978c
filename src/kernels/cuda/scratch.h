// Scratch memory for the CUDA kernels' temporary data (partial sums, index lists).
// Each slot is a grow-only device buffer kept for the life of the process, so a kernel
// launcher asks for its scratch every call without a cudaMalloc/cudaFree pair (cudaFree
// synchronizes the device). Slots are per purpose so two launchers never share one; all
// work runs on one stream, so a slot is free again as soon as its kernel was enqueued
// after the previous use.
#pragma once

#include <cstddef>

namespace forge::cuda {

enum class ScratchSlot {
  RmsnormPartials,
  SumOfSquaresPartials,
  EmbeddingIndex,
  QkNormRopePartials,
  BiasGradientPartials,
  ConvPaddedInput,
  GroupNormPartials,
  GroupNormStatistics,
  DenseAttention,
  Count
};

void* scratch_buffer(ScratchSlot slot, size_t bytes);

}  // namespace forge::cuda
