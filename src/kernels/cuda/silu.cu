// SiLU on the GPU, bf16 in and out, fp32 inside:
//   out = x s,  s = 1 / (1 + e^-x);   din = dout s (1 + x (1 - s))
// For very negative x, e^-x is inf and s exactly 0: the right limit of both.
// Elementwise and memory-bound: each thread takes 8 consecutive elements, with 16-byte
// loads and stores when every pointer is 16-byte aligned and the 8 lie inside the tensor;
// the last partial group (or a tensor that is not aligned) goes element by element.
#include "kernels/cuda/silu.h"

#include <cstdint>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float sigmoid(float x) { return 1.f / (1.f + __expf(-x)); }

__device__ __forceinline__ float silu_grad(float dout, float x) {
  const float s = sigmoid(x);
  return dout * s * (1.f + x * (1.f - s));
}

__global__ void forward_kernel(bf16* out, const bf16* in, int64_t n, bool vector) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (first >= n) return;
  if (vector && first + 8 <= n) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(in + first), f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] *= sigmoid(f[k]);
    *reinterpret_cast<uint4*>(out + first) = pack8(f);
    return;
  }
  for (int64_t i = first; i < n && i < first + 8; ++i) {
    const float x = __bfloat162float(in[i]);
    out[i] = __float2bfloat16(x * sigmoid(x));
  }
}

__global__ void backward_kernel(bf16* din, const bf16* dout, const bf16* in,
                                int64_t n, bool vector) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (first >= n) return;
  if (vector && first + 8 <= n) {
    float x[8], d[8];
    unpack8(*reinterpret_cast<const uint4*>(in + first), x);
    unpack8(*reinterpret_cast<const uint4*>(dout + first), d);
#pragma unroll
    for (int k = 0; k < 8; ++k) d[k] = silu_grad(d[k], x[k]);
    *reinterpret_cast<uint4*>(din + first) = pack8(d);
    return;
  }
  for (int64_t i = first; i < n && i < first + 8; ++i)
    din[i] = __float2bfloat16(silu_grad(__bfloat162float(dout[i]), __bfloat162float(in[i])));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(((n + 7) / 8 + kThreads - 1) / kThreads); }

}  // namespace

void silu_forward(bf16* out, const bf16* in, int64_t n) {
  if (n == 0) return;
  forward_kernel<<<blocks_for(n), kThreads>>>(out, in, n, aligned16(out) && aligned16(in));
  FORGE_CUDA_LAUNCH_CHECK();
}

void silu_backward(bf16* din, const bf16* dout, const bf16* in, int64_t n) {
  if (n == 0) return;
  backward_kernel<<<blocks_for(n), kThreads>>>(din, dout, in, n, aligned16(din) && aligned16(dout) && aligned16(in));
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
