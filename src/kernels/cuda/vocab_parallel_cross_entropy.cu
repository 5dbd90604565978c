// Softmax cross-entropy over one shard of the vocabulary on the GPU, in the three phases
// of NOTE [Vocabulary-parallel cross-entropy], each a kernel with one block per row of
// bf16 logits x (the shard's columns), everything computed in fp32:
//   max:    row_max = max(x).
//   sums:   sum(exp(x - m)) with m the group's max, and x[target] where the shard holds it.
//   finish: lse = m + log(sum), loss = lse - x[target], and when asked
//           dlogits = scale * (exp(x - lse) - onehot(target)), in place or to a separate buffer.
// The caller's all-reduces sit between the phases, so the shard's row is read three times
// (max, sums, gradient) and written once, where the unsharded kernel
// (kernels/cuda/cross_entropy.cu) reads and writes the full row once each. A shard is a
// T-th of the row, so a rank moves 4/T rows' worth where the unsharded op moves 2.
//
// Each thread walks its row 8 bf16 logits (16 bytes) at a time, and the block combines the
// threads' max or sum through warp shuffles and one shared-memory step. A block has the
// fewest warps that give each thread at least one 16-byte vector, up to 512 threads, so a
// short shard (a small vocabulary split 8 ways) does not leave most of a block idle. Rows
// whose length or addresses do not allow 16-byte accesses take a scalar path. The finish
// reads each element only to write its own gradient, so dlogits may alias logits. Rows
// whose target is ignored are never read: their sums, loss and gradient are zeros. Targets
// outside the vocabulary are the data layer's job to reject.
#include "kernels/cuda/vocab_parallel_cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kMaxThreads = 512;
constexpr int kVector = 8;  // bf16 values per 16-byte access

struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

struct Sum {
  __device__ float operator()(float a, float b) const { return a + b; }
};

// The block's reduction of every thread's value, returned to every thread. Called once per
// kernel (its shared memory is not reused).
template <typename Op>
__device__ float block_reduce(float value, Op op) {
  __shared__ float warp_partials[kMaxThreads / 32];
  for (int o = 16; o > 0; o >>= 1) value = op(value, __shfl_xor_sync(0xffffffffu, value, o));
  if (threadIdx.x % 32 == 0) warp_partials[threadIdx.x / 32] = value;
  __syncthreads();
  value = warp_partials[0];
  for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) value = op(value, warp_partials[w]);
  return value;
}

// f(value) applied to every logit of row x, 8 at a time where `vectorized`, and folded with
// op into this thread's partial.
template <typename Op, typename F>
__device__ float fold_row(const bf16* x, int64_t vocab, bool vectorized, float init, Op op, F f) {
  float acc = init;
  if (vectorized) {
    for (int64_t v = threadIdx.x * kVector; v < vocab; v += blockDim.x * kVector) {
      float values[kVector];
      unpack8(*reinterpret_cast<const uint4*>(x + v), values);
#pragma unroll
      for (int i = 0; i < kVector; ++i) acc = op(acc, f(values[i]));
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) acc = op(acc, f(__bfloat162float(x[v])));
  }
  return acc;
}

__global__ void row_max_kernel(float* row_max, const bf16* logits, int64_t vocab, bool vectorized) {
  const int64_t row = blockIdx.x;
  float m = fold_row(logits + row * vocab, vocab, vectorized, -INFINITY, Max{}, [](float value) { return value; });
  m = block_reduce(m, Max{});
  if (threadIdx.x == 0) row_max[row] = m;
}

__global__ void sums_kernel(float* sums, const bf16* logits, const float* row_max, const int32_t* targets,
                            int64_t rows, int64_t vocab, int64_t vocab_begin, int32_t ignore_index, bool vectorized) {
  const int64_t row = blockIdx.x;
  const int32_t target = targets[row];
  if (target == ignore_index) {
    if (threadIdx.x == 0) sums[row] = sums[rows + row] = 0.f;
    return;
  }
  const bf16* x = logits + row * vocab;
  const float m = row_max[row];
  float s = fold_row(x, vocab, vectorized, 0.f, Sum{}, [m](float value) { return __expf(value - m); });
  s = block_reduce(s, Sum{});
  if (threadIdx.x == 0) {
    const int64_t column = target - vocab_begin;
    sums[row] = s;
    sums[rows + row] = column >= 0 && column < vocab ? __bfloat162float(x[column]) : 0.f;
  }
}

__global__ void finish_kernel(float* losses, bf16* dlogits, const bf16* logits, const float* row_max,
                              const float* sums, const int32_t* targets, int64_t rows, int64_t vocab,
                              int64_t vocab_begin, int32_t ignore_index, float grad_scale, bool vectorized) {
  const int64_t row = blockIdx.x;
  const bf16* x = logits + row * vocab;
  bf16* dx = dlogits ? dlogits + row * vocab : nullptr;
  const int32_t target = targets[row];
  const bool ignored = target == ignore_index;
  const float lse = ignored ? 0.f : row_max[row] + logf(sums[row]);
  if (threadIdx.x == 0) losses[row] = ignored ? 0.f : lse - sums[rows + row];
  if (!dx) return;
  // The target's column in the shard; any value outside [0, vocab) matches no column.
  const int64_t column = target - vocab_begin;
  const float scale = ignored ? 0.f : grad_scale;
  if (vectorized) {
    for (int64_t v = threadIdx.x * kVector; v < vocab; v += blockDim.x * kVector) {
      float values[kVector] = {};
      if (!ignored) unpack8(*reinterpret_cast<const uint4*>(x + v), values);
#pragma unroll
      for (int i = 0; i < kVector; ++i)
        values[i] = scale * (__expf(values[i] - lse) - (v + i == column ? 1.f : 0.f));
      *reinterpret_cast<uint4*>(dx + v) = pack8(values);
    }
  } else {
    for (int64_t v = threadIdx.x; v < vocab; v += blockDim.x) {
      const float value = ignored ? 0.f : __bfloat162float(x[v]);
      dx[v] = __float2bfloat16(scale * (__expf(value - lse) - (v == column ? 1.f : 0.f)));
    }
  }
}

// The fewest warps whose threads each get at least one 16-byte vector, up to kMaxThreads.
unsigned threads_for(int64_t vocab) {
  const int64_t vectors = (vocab + kVector - 1) / kVector;
  return static_cast<unsigned>(std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, (vectors + 31) / 32 * 32)));
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

void vocab_parallel_cross_entropy_max(float* row_max, const bf16* logits, int64_t rows, int64_t vocab) {
  if (!rows) return;
  const bool vectorized = vocab % kVector == 0 && aligned16(logits);
  row_max_kernel<<<static_cast<unsigned>(rows), threads_for(vocab)>>>(row_max, logits, vocab, vectorized);
  FORGE_CUDA_LAUNCH_CHECK();
}

void vocab_parallel_cross_entropy_sums(float* sums, const bf16* logits, const float* row_max, const int32_t* targets,
                                       int64_t rows, int64_t vocab, int64_t vocab_begin, int32_t ignore_index) {
  if (!rows) return;
  const bool vectorized = vocab % kVector == 0 && aligned16(logits);
  sums_kernel<<<static_cast<unsigned>(rows), threads_for(vocab)>>>(sums, logits, row_max, targets, rows, vocab,
                                                                   vocab_begin, ignore_index, vectorized);
  FORGE_CUDA_LAUNCH_CHECK();
}

void vocab_parallel_cross_entropy_finish(float* losses, bf16* dlogits, const bf16* logits, const float* row_max,
                                         const float* sums, const int32_t* targets, int64_t rows, int64_t vocab,
                                         int64_t vocab_begin, int32_t ignore_index, float grad_scale) {
  if (!rows) return;
  const bool vectorized = vocab % kVector == 0 && aligned16(logits) && aligned16(dlogits);
  const unsigned threads = dlogits ? threads_for(vocab) : 32;  // only the loss: one thread a row works
  finish_kernel<<<static_cast<unsigned>(rows), threads>>>(losses, dlogits, logits, row_max, sums, targets, rows, vocab,
                                                          vocab_begin, ignore_index, grad_scale, vectorized);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
