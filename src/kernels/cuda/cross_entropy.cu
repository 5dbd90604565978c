// Softmax cross-entropy on the GPU, fused with its gradient.
//
// One block per row of logits. Pass 1 reads the row once with an online softmax: each
// thread keeps a running max and a running sum of exp(x - max), rescaling the sum when
// the max grows; the block then merges the (max, sum) pairs. loss = log(sum) + max -
// x[target]. Pass 2 (training) re-reads the row (from L2 for vocabularies up to a few
// hundred thousand) and writes dlogits = scale * (exp(x - lse) - onehot) in place or to
// a separate buffer. Everything is computed in fp32 from bf16 inputs. Out-of-range
// targets are the data layer's job to reject; ignored rows get loss 0 and zero gradient.
#include "kernels/cuda/cross_entropy.h"

#include <cfloat>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 512;

struct MaxSum {
  float max, sum;
};

__device__ MaxSum merge(MaxSum a, MaxSum b) {
  float m = fmaxf(a.max, b.max);
  if (m == -FLT_MAX) return {m, 0.f};
  return {m, a.sum * __expf(a.max - m) + b.sum * __expf(b.max - m)};
}

__global__ void cross_entropy_kernel(float* losses, bf16* dlogits, const bf16* logits, const int32_t* targets,
                                     int64_t vocab, int32_t ignore_index, float grad_scale) {
  __shared__ MaxSum shared[kThreads / 32];
  __shared__ float shared_lse;
  int64_t row = blockIdx.x;
  const bf16* x = logits + row * vocab;
  int32_t target = targets[row];
  bool ignored = target == ignore_index;

  MaxSum acc{-FLT_MAX, 0.f};
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) acc = merge(acc, MaxSum{__bfloat162float(x[v]), 1.f});
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
  if (!dlogits) return;
  float lse = shared_lse;
  bf16* dx = dlogits + row * vocab;
  for (int64_t v = threadIdx.x; v < vocab; v += kThreads) {
    float g = ignored ? 0.f : grad_scale * (__expf(__bfloat162float(x[v]) - lse) - (v == target ? 1.f : 0.f));
    dx[v] = __float2bfloat16(g);
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
