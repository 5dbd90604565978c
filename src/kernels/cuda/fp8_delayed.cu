// The step-end pass over the FP8 projections' statistics (NOTE [FP8 projection statistics]
// in kernels/cpu/fp8_scaling.h): a handful of values per projection, a few hundred
// projections, so one thread per (projection, role) and no cleverness. The delayed update
// follows the CPU's fp8_delayed_scale_update (Transformer Engine's amax_and_scale_update)
// operation for operation: fmaxf over the history (NaN ignored, as TE's kernel), history[0]
// alone for most_recent, the roll, and scaled_max / amax in fp32 when that amax is finite
// and positive, the previous scale otherwise; scaled_max = fp8_max * 2^-margin comes from the
// host, so it is the CPU's value exactly. The search for a non-finite seen amax folds each
// slot's index into one integer with atomicMin, so the first in projection order wins
// whatever order the threads run in.
#include "kernels/cuda/fp8_delayed.h"

#include <cuda_runtime.h>

#include <climits>
#include <cmath>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

using cpu::Fp8Role;
using cpu::kFp8Roles;

constexpr int kThreads = 128;

unsigned blocks_for(int64_t slots) { return static_cast<unsigned>((slots + kThreads - 1) / kThreads); }

// cpu::fp8_seen_offset of slot = projection * kFp8Roles + role (written out: a host constexpr
// function is not callable from device code without --expt-relaxed-constexpr).
__device__ int64_t seen_at(int64_t slot) {
  return slot / kFp8Roles * cpu::kFp8ProjectionStats + 3 * (slot % kFp8Roles) * cpu::kFp8StatStride;
}

__global__ void init_kernel(float* stats, int64_t slots) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= slots) return;
  float* s = stats + seen_at(slot);
  s[0] = 0.0f;
  s[cpu::kFp8StatStride] = 1.0f;
  s[2 * cpu::kFp8StatStride] = 1.0f;
}

__global__ void first_nonfinite_kernel(const float* stats, int64_t slots, int* first) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot < slots && !isfinite(stats[seen_at(slot)])) atomicMin(first, static_cast<int>(slot));
}

__global__ void delayed_kernel(float* stats, float* history, int64_t slots, int64_t length, bool most_recent,
                               float scaled_max_e4m3, float scaled_max_grad) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot >= slots) return;
  float* s = stats + seen_at(slot);
  float* h = history + slot * length;
  const float newest = s[0];
  h[0] = newest;
  float amax = 0.0f;
  for (int64_t i = 0; i < length; ++i) amax = fmaxf(amax, h[i]);
  if (most_recent) amax = newest;
  for (int64_t i = 1; i + 1 < length; ++i) h[i] = h[i + 1];
  if (length > 1) h[length - 1] = newest;
  h[0] = 0.0f;
  const float scaled_max = slot % kFp8Roles == 2 /* Fp8Role::Dy */ ? scaled_max_grad : scaled_max_e4m3;
  const float scale = isfinite(amax) && amax > 0.0f ? scaled_max / amax : s[cpu::kFp8StatStride];
  s[cpu::kFp8StatStride] = scale;
  s[2 * cpu::kFp8StatStride] = 1.0f / scale;
  s[0] = 0.0f;
}

__global__ void clear_kernel(float* stats, int64_t slots) {
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (slot < slots) stats[seen_at(slot)] = 0.0f;
}

}  // namespace

void fp8_init_stats(float* stats, int64_t projections) {
  const int64_t slots = projections * kFp8Roles;
  if (slots == 0) return;
  init_kernel<<<blocks_for(slots), kThreads>>>(stats, slots);
  FORGE_CUDA_LAUNCH_CHECK();
}

int64_t fp8_first_nonfinite_seen(const float* stats, int64_t projections) {
  const int64_t slots = projections * kFp8Roles;
  if (slots == 0) return -1;
  int* first = nullptr;
  CUDA_CHECK(cudaMallocAsync(&first, sizeof(int), nullptr));
  const int none = INT_MAX;
  CUDA_CHECK(cudaMemcpyAsync(first, &none, sizeof(int), cudaMemcpyHostToDevice, nullptr));
  first_nonfinite_kernel<<<blocks_for(slots), kThreads>>>(stats, slots, first);
  FORGE_CUDA_LAUNCH_CHECK();
  int found = INT_MAX;
  CUDA_CHECK(cudaMemcpyAsync(&found, first, sizeof(int), cudaMemcpyDeviceToHost, nullptr));
  CUDA_CHECK(cudaFreeAsync(first, nullptr));
  CUDA_CHECK(cudaStreamSynchronize(nullptr));
  return found == INT_MAX ? -1 : found;
}

void fp8_delayed_step(float* stats, float* history, int64_t projections, const cpu::Fp8DelayedRecipe& recipe) {
  const int64_t slots = projections * kFp8Roles;
  if (slots == 0) return;
  const float two_to_minus_margin = std::pow(2.0f, -recipe.margin);  // as the CPU reference computes it
  delayed_kernel<<<blocks_for(slots), kThreads>>>(
      stats, history, slots, recipe.history_length, recipe.algorithm == cpu::Fp8AmaxAlgorithm::MostRecent,
      cpu::fp8_max(cpu::Fp8Format::E4M3) * two_to_minus_margin, cpu::fp8_max(recipe.grad_format) * two_to_minus_margin);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_clear_seen(float* stats, int64_t projections) {
  const int64_t slots = projections * kFp8Roles;
  if (slots == 0) return;
  clear_kernel<<<blocks_for(slots), kThreads>>>(stats, slots);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
