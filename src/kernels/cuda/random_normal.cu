// Standard normals on the GPU from the counter-based generator the CPU reference runs too
// (NOTE [Counter-based normals] in kernels/philox.h): one thread per Philox block, i.e. per
// four consecutive numbers of the stream, so a thread costs ten rounds of two 32-bit
// multiplies and two Box-Muller transforms and stores four values. Blocks are numbered from
// the one holding number `offset`; the first and last may be partly outside `out` and write
// only their lanes inside it. Nothing depends on the launch shape: any grid gives the same
// numbers. Each number costs a few dozen integer and special-function instructions against
// 4 or 2 bytes written once: a cheap op beside the transformer it feeds (not tuned further).
#include "kernels/cuda/random_normal.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/philox.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16* p, float v) { *p = __float2bfloat16(v); }

template <typename T>
__global__ void random_normal_kernel(T* out, int64_t n, uint64_t seed, uint64_t offset, int64_t blocks) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= blocks) return;
  const uint64_t block = offset / 4 + static_cast<uint64_t>(t);
  float z[4];
  philox::normal4(seed, block, z);
#pragma unroll
  for (int lane = 0; lane < 4; ++lane) {
    const uint64_t k = block * 4 + lane;
    if (k >= offset && k - offset < static_cast<uint64_t>(n)) store(out + (k - offset), z[lane]);
  }
}

template <typename T>
void launch(T* out, int64_t n, uint64_t seed, uint64_t offset) {
  if (n == 0) return;
  const int64_t blocks = static_cast<int64_t>((offset + static_cast<uint64_t>(n) - 1) / 4 - offset / 4 + 1);
  random_normal_kernel<T><<<static_cast<unsigned>((blocks + kThreads - 1) / kThreads), kThreads>>>(out, n, seed,
                                                                                                   offset, blocks);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void random_normal(float* out, int64_t n, uint64_t seed, uint64_t offset) { launch(out, n, seed, offset); }
void random_normal(bf16* out, int64_t n, uint64_t seed, uint64_t offset) { launch(out, n, seed, offset); }

}  // namespace forge::cuda
