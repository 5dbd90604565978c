// Elementwise helpers on the GPU: dtype casts, the accumulation of reduced gradient
// shards (on the stream FSDP communicates on) and of bf16 partial gradients (the key/value
// gradients of context parallelism's two query chunks, summed in fp32 and rounded once),
// and the sum of squares behind the global gradient norm. The sum is deterministic: a
// fixed grid of blocks each reduces a fixed strided subset in fp64 (warp shuffles, then
// shared memory), writes one partial, and the host adds the partials in block order.
#include "kernels/cuda/elementwise.h"

#include <algorithm>
#include <vector>

#include "core/device.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kSumBlocks = 1024;

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

__global__ void cast_to_bf16_kernel(bf16* out, const float* in, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __float2bfloat16(in[i]);
}

__global__ void cast_to_float_kernel(float* out, const bf16* in, int64_t n) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __bfloat162float(in[i]);
}

template <typename Dst, typename Src>
__global__ void accumulate_kernel(Dst* dst, const Src* src, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = static_cast<Dst>(static_cast<float>(dst[i]) + static_cast<float>(src[i]));
}

template <typename Dst, typename Src>
void launch_accumulate(Dst* dst, const Src* src, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((n + kThreads - 1) / kThreads, 8192));
  accumulate_kernel<<<blocks, kThreads, 0, stream>>>(dst, src, n);
  FORGE_CUDA_LAUNCH_CHECK();
}

__global__ void sum_of_squares_kernel(double* partial, const float* a, int64_t n) {
  __shared__ double warp_sums[kThreads / 32];
  double s = 0.0;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    s += static_cast<double>(a[i]) * a[i];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
    partial[blockIdx.x] = total;
  }
}

}  // namespace

double sum_of_squares(const float* a, int64_t n) {
  if (n == 0) return 0.0;
  double* partial =
      static_cast<double*>(scratch_buffer(ScratchSlot::SumOfSquaresPartials, sizeof(double) * kSumBlocks));
  sum_of_squares_kernel<<<kSumBlocks, kThreads>>>(partial, a, n);
  FORGE_CUDA_LAUNCH_CHECK();
  std::vector<double> host(kSumBlocks);
  copy_bytes(host.data(), Device::CPU, partial, Device::CUDA, sizeof(double) * kSumBlocks);
  double total = 0.0;
  for (double p : host) total += p;
  return total;
}

void cast(bf16* out, const float* in, int64_t n, cudaStream_t stream) {
  if (n) cast_to_bf16_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, in, n);
  FORGE_CUDA_LAUNCH_CHECK();
}

void cast(float* out, const bf16* in, int64_t n, cudaStream_t stream) {
  if (n) cast_to_float_kernel<<<blocks_for(n), kThreads, 0, stream>>>(out, in, n);
  FORGE_CUDA_LAUNCH_CHECK();
}

void accumulate(float* dst, const float* src, int64_t n, cudaStream_t stream) {
  launch_accumulate(dst, src, n, stream);
}

void accumulate(float* dst, const bf16* src, int64_t n, cudaStream_t stream) {
  launch_accumulate(dst, src, n, stream);
}

void accumulate(bf16* dst, const bf16* src, int64_t n, cudaStream_t stream) { launch_accumulate(dst, src, n, stream); }

}  // namespace forge::cuda
