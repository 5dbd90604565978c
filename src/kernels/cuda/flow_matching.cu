// Rectified-flow training on the GPU (ops/flow_matching.h): the noisy input and velocity
// target of each sample, and the mean squared error with its gradient, fp32 or bf16 tensors
// with fp32 arithmetic.
//
// The pair is elementwise: thread i reads x0 and noise once and writes x_t = (1 - t) x0 +
// t noise and v = noise - x0, t taken from its sample's entry (i / per_sample), which every
// thread of a sample reads from the same cached line.
//
// The loss is written once per element (dpred) and reduced to one number. It must be
// deterministic, so no float atomics: a grid of min(1024, n / 1024) blocks of 256 threads
// (a shape fixed by n) walks the elements with a grid stride; each thread sums its squares
// in fp32 while it writes the gradient, a block folds its threads (butterfly shuffles, then
// its warps in order) into one partial, and a second kernel of one block folds the partials
// in the same way and adds sum / count to the loss. Same n and inputs, same bits. The
// partials live in a fixed device array of this file (1024 floats), not in kernels/cuda/
// scratch.h's grow-only slots: their size never changes, and like every scratch buffer it
// is reused in stream order (all work runs on one stream).
#include "kernels/cuda/flow_matching.h"

#include <algorithm>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;
constexpr int kWarp = 32;

__device__ float g_mse_partials[kMaxBlocks];

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ float load(const bf16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16* p, float v) { *p = __float2bfloat16(v); }

template <typename T>
__global__ void flow_matching_pair_kernel(T* noisy, T* target, const T* x0, const T* noise, const float* t,
                                          int64_t per_sample, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float tb = __ldg(t + i / per_sample), x = load(x0 + i), z = load(noise + i);
  store(noisy + i, (1.0f - tb) * x + tb * z);
  store(target + i, z - x);
}

// The sum of v over the block in a fixed order, valid in thread 0. Every thread must call it.
__device__ float block_sum(float v) {
  __shared__ float warp_sums[kMaxBlocks / kWarp];
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = v;
  __syncthreads();
  float total = 0.0f;
  if (threadIdx.x == 0)
    for (int w = 0; w < static_cast<int>(blockDim.x) / kWarp; ++w) total += warp_sums[w];
  return total;
}

template <typename T>
__global__ void mse_partials_kernel(T* dpred, const T* pred, const T* target, int64_t n, float scale) {
  float sum = 0.0f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const float d = load(pred + i) - load(target + i);
    sum += d * d;
    store(dpred + i, scale * d);
  }
  sum = block_sum(sum);
  if (threadIdx.x == 0) g_mse_partials[blockIdx.x] = sum;
}

// One block of kMaxBlocks threads: thread b holds partial b (0 past the last).
__global__ void mse_finish_kernel(float* loss, int blocks, float inv_count) {
  const float total = block_sum(static_cast<int>(threadIdx.x) < blocks ? g_mse_partials[threadIdx.x] : 0.0f);
  if (threadIdx.x == 0) loss[0] += total * inv_count;
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

template <typename T>
void launch_pair(T* noisy, T* target, const T* x0, const T* noise, const float* t, int64_t batch,
                 int64_t per_sample) {
  const int64_t n = batch * per_sample;
  if (n == 0) return;
  flow_matching_pair_kernel<T><<<blocks_for(n, kThreads), kThreads>>>(noisy, target, x0, noise, t, per_sample, n);
  FORGE_CUDA_LAUNCH_CHECK();
}

template <typename T>
void launch_mse(float* loss, T* dpred, const T* pred, const T* target, int64_t n, float scale, float inv_count) {
  const int blocks = static_cast<int>(std::clamp<int64_t>(n / (4 * kThreads), 1, kMaxBlocks));
  mse_partials_kernel<T><<<blocks, kThreads>>>(dpred, pred, target, n, scale);
  FORGE_CUDA_LAUNCH_CHECK();
  mse_finish_kernel<<<1, kMaxBlocks>>>(loss, blocks, inv_count);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void flow_matching_pair(float* noisy, float* target, const float* x0, const float* noise, const float* t,
                        int64_t batch, int64_t per_sample) {
  launch_pair(noisy, target, x0, noise, t, batch, per_sample);
}
void flow_matching_pair(bf16* noisy, bf16* target, const bf16* x0, const bf16* noise, const float* t,
                        int64_t batch, int64_t per_sample) {
  launch_pair(noisy, target, x0, noise, t, batch, per_sample);
}
void mse_loss(float* loss, float* dpred, const float* pred, const float* target, int64_t n, float scale,
              float inv_count) {
  launch_mse(loss, dpred, pred, target, n, scale, inv_count);
}
void mse_loss(float* loss, bf16* dpred, const bf16* pred, const bf16* target, int64_t n, float scale,
              float inv_count) {
  launch_mse(loss, dpred, pred, target, n, scale, inv_count);
}

}  // namespace forge::cuda
