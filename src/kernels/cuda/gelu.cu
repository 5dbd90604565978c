// GELU (tanh approximation) on the GPU, bf16 in and out, fp32 inside:
//   out = 0.5 x (1 + tanh u),  u = sqrt(2/pi) (x + 0.044715 x^3)
//   din = dout (0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2))
// Elementwise and memory-bound: each thread takes 8 consecutive elements, with 16-byte
// loads and stores when every pointer is 16-byte aligned and the 8 lie inside the tensor;
// the last partial group (or a tensor that is not aligned) goes element by element.
// The exact GELU, 0.5 x (1 + erf(x / sqrt 2)), and CLIP's quick GELU, x / (1 + e^(-1.702 x))
// (e^(-1.702 x) overflows to infinity far left: 0, the right limit), run forward the same
// way through one kernel template on the element's function. A thread reads its 8 elements
// before writing them, so out may be in.
#include "kernels/cuda/gelu.h"

#include <cstdint>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kQuickGeluScale = 1.702f;

__device__ __forceinline__ float gelu(float x) {
  return 0.5f * x * (1.f + tanhf(kSqrt2OverPi * (x + kCubic * x * x * x)));
}

__device__ __forceinline__ float gelu_grad(float dout, float x) {
  const float th = tanhf(kSqrt2OverPi * (x + kCubic * x * x * x));
  return dout * (0.5f * (1.f + th) + 0.5f * x * (1.f - th * th) * kSqrt2OverPi * (1.f + 3.f * kCubic * x * x));
}

__global__ void forward_kernel(bf16* out, const bf16* in, int64_t n, bool vector) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (first >= n) return;
  if (vector && first + 8 <= n) {
    float f[8];
    unpack8(*reinterpret_cast<const uint4*>(in + first), f);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = gelu(f[k]);
    *reinterpret_cast<uint4*>(out + first) = pack8(f);
    return;
  }
  for (int64_t i = first; i < n && i < first + 8; ++i) out[i] = __float2bfloat16(gelu(__bfloat162float(in[i])));
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
    for (int k = 0; k < 8; ++k) d[k] = gelu_grad(d[k], x[k]);
    *reinterpret_cast<uint4*>(din + first) = pack8(d);
    return;
  }
  for (int64_t i = first; i < n && i < first + 8; ++i)
    din[i] = __float2bfloat16(gelu_grad(__bfloat162float(dout[i]), __bfloat162float(in[i])));
}

struct GeluErf {
  __device__ __forceinline__ float operator()(float x) const { return 0.5f * x * (1.f + erff(x * kInvSqrt2)); }
};
struct QuickGelu {
  __device__ __forceinline__ float operator()(float x) const { return x / (1.f + __expf(-kQuickGeluScale * x)); }
};

template <typename Function>
__global__ void unary_forward_kernel(bf16* out, const bf16* in, int64_t n, bool vector, Function f) {
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
  if (first >= n) return;
  if (vector && first + 8 <= n) {
    float v[8];
    unpack8(*reinterpret_cast<const uint4*>(in + first), v);
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = f(v[k]);
    *reinterpret_cast<uint4*>(out + first) = pack8(v);
    return;
  }
  for (int64_t i = first; i < n && i < first + 8; ++i) out[i] = __float2bfloat16(f(__bfloat162float(in[i])));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned blocks_for(int64_t n) { return static_cast<unsigned>(((n + 7) / 8 + kThreads - 1) / kThreads); }

template <typename Function>
void unary_forward(bf16* out, const bf16* in, int64_t n, Function f) {
  if (n == 0) return;
  unary_forward_kernel<<<blocks_for(n), kThreads>>>(out, in, n, aligned16(out) && aligned16(in), f);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void gelu_tanh_forward(bf16* out, const bf16* in, int64_t n) {
  if (n == 0) return;
  forward_kernel<<<blocks_for(n), kThreads>>>(out, in, n, aligned16(out) && aligned16(in));
  FORGE_CUDA_LAUNCH_CHECK();
}

void gelu_tanh_backward(bf16* din, const bf16* dout, const bf16* in, int64_t n) {
  if (n == 0) return;
  backward_kernel<<<blocks_for(n), kThreads>>>(din, dout, in, n, aligned16(din) && aligned16(dout) && aligned16(in));
  FORGE_CUDA_LAUNCH_CHECK();
}

void gelu_erf_forward(bf16* out, const bf16* in, int64_t n) { unary_forward(out, in, n, GeluErf{}); }

void quick_gelu_forward(bf16* out, const bf16* in, int64_t n) { unary_forward(out, in, n, QuickGelu{}); }

}  // namespace forge::cuda
