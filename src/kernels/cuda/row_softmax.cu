// Row softmax on the GPU, fp32 scores to bf16 probabilities (ops/row_softmax.h): one block
// of 256 threads per row and three passes over it, the maximum, the sum of exp(x - max)
// (fp32, each thread's strided share, then a warp butterfly and the warps' sums in order:
// the same bits every run), and the quotients. A row of the VAE attention's scores is 64 KB
// at 1024x1024 (16384 latent pixels): the second and third passes find it in L2.
#include "kernels/cuda/row_softmax.h"

#include <cfloat>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The block's reduction of `value` by op, returned to every thread.
template <typename Op>
__device__ float block_reduce(float value, Op op, float* shared) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) value = op(value, __shfl_xor_sync(0xffffffffu, value, offset));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = value;
  __syncthreads();
  float total = shared[0];
  for (int w = 1; w < kWarps; ++w) total = op(total, shared[w]);
  __syncthreads();  // shared is free for the next reduction
  return total;
}

__global__ void softmax_kernel(bf16* probs, const float* scores, int64_t cols) {
  __shared__ float shared[kWarps];
  const float* x = scores + static_cast<int64_t>(blockIdx.x) * cols;
  bf16* y = probs + static_cast<int64_t>(blockIdx.x) * cols;
  float top = -FLT_MAX;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) top = fmaxf(top, x[j]);
  top = block_reduce(top, [](float a, float b) { return fmaxf(a, b); }, shared);
  float sum = 0.f;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) sum += __expf(x[j] - top);
  sum = block_reduce(sum, [](float a, float b) { return a + b; }, shared);
  const float inverse = 1.f / sum;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) y[j] = __float2bfloat16(__expf(x[j] - top) * inverse);
}

}  // namespace

void row_softmax(bf16* probs, const float* scores, int64_t rows, int64_t cols) {
  if (rows == 0 || cols == 0) return;
  softmax_kernel<<<static_cast<unsigned>(rows), kThreads>>>(probs, scores, cols);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
