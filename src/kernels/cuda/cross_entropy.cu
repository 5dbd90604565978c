// Softmax cross-entropy on the GPU, fused with its gradient.
//
// One block per row of logits. Pass 1 reads the row once with an online softmax: each
// thread keeps a running max and a running sum of exp(x - max). It loads 8 bf16 logits
// (16 bytes) at a time, takes their max first and rescales its sum at most once per
// load, so the exponentials cost one per logit; the block then merges the (max, sum)
// pairs. loss = log(sum) + max - x[target]. Pass 2 (training) re-reads the row and writes
// dlogits = scale * (exp(x - lse) - onehot), 8 values per store, in place or to a separate
// buffer. Everything is computed in fp32 from bf16 inputs. The traffic is two reads and
// one write of the bf16 logits, so at Llama 3's vocabulary this runs at memory bandwidth.
// Rows whose length or address does not allow 16-byte accesses take a scalar path.
// Out-of-range targets are the data layer's job to reject; ignored rows get loss 0 and
// zero gradient.
#include "kernels/cuda/cross_entropy.h"

#include <cfloat>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kVector = 8;  // bf16 values per 16-byte access

struct MaxSum {
  float max, sum;
};

__device__ MaxSum merge(MaxSum a, MaxSum b) {
  float m = fmaxf(a.max, b.max);
  if (m == -FLT_MAX) return {m, 0.f};
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

// Adds n values (already in fp32) to a thread's running (max, sum).
__device__ void accumulate(MaxSum& acc, const float* x, int n) {
  float m = acc.max;
  for (int i = 0; i < n; ++i) m = fmaxf(m, x[i]);
  if (m > acc.max) {
    acc.sum = acc.max == -FLT_MAX ? 0.f : acc.sum * __expf(acc.max - m);
    acc.max = m;
  }
  for (int i = 0; i < n; ++i) acc.sum += __expf(x[i] - m);
}

__device__ void load8(float* out, const bf16* p) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

__device__ void store8(bf16* p, const float* in) {
  uint4 raw;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__global__ void cross_entropy_kernel(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                     int64_t vocab, int32_t ignore_index, float grad_scale) {
  __shared__ MaxSum shared[kThreads / 32];
  __shared__ float shared_lse;
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * vocab;
  bf16* dx = dlogits ? dlogits + row * vocab : nullptr;
  const int32_t target = targets[row];
  const bool ignored = target == ignore_index;
  const bool vectorized = vocab % kVector == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0 &&
                          (!dx || reinterpret_cast<uintptr_t>(dx) % 16 == 0);

  MaxSum acc{-FLT_MAX, 0.f};
  if (vectorized) {
    for (int64_t v = threadIdx.x * kVector; v < vocab; v += kThreads * kVector) {
      float values[kVector];
      load8(values, x + v);
      accumulate(acc, values, kVector);
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
      float value = __bfloat162float(x[v]);
      accumulate(acc, &value, 1);
    }
  }
  for (int o = 16; o > 0; o >>= 1)
    acc = merge(acc, MaxSum{__shfl_xor_sync(0xffffffffu, acc.max, o), __shfl_xor_sync(0xffffffffu, acc.sum, o)});
  if (threadIdx.x % 32 == 0) shared[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    MaxSum total = shared[0];
    for (int w = 1; w < kThreads / 32; ++w) total = merge(total, shared[w]);
    float lse = logf(total.sum) + total.max;
    shared_lse = lse;
    losses[row] = ignored ? 0.f : lse - __bfloat162float(x[target]);
  }
  __syncthreads();
  if (!dx) return;
  const float lse = shared_lse;
  const float scale = ignored ? 0.f : grad_scale;
  if (vectorized) {
    for (int64_t v = threadIdx.x * kVector; v < vocab; v += kThreads * kVector) {
      float values[kVector];
      load8(values, x + v);
#pragma unroll
      for (int i = 0; i < kVector; ++i)
        values[i] = scale * (__expf(values[i] - lse) - (v + i == target ? 1.f : 0.f));
      store8(dx + v, values);
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += kThreads)
      dx[v] = __float2bfloat16(scale * (__expf(__bfloat162float(x[v]) - lse) - (v == target ? 1.f : 0.f)));
  }
}

}  // namespace

void cross_entropy_forward_backward(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                    int64_t rows, int64_t vocab, int32_t ignore_index, float grad_scale) {
  if (rows)
    cross_entropy_kernel<<<static_cast<unsigned>(rows), kThreads>>>(losses, dlogits, logits, targets, vocab,
                                                                   ignore_index, grad_scale);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
