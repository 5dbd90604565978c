// Token embedding on the GPU.
//
// Forward: a row copy, one thread per 8 columns with 16-byte loads and stores.
//
// Backward: dtable[tokens[n]] += dout[n] must be deterministic, so no atomics: each
// thread owns one column d and walks the tokens in order, adding dout[n, d] into
// dtable[tokens[n], d]. Threads of a warp touch consecutive columns of the same row, so
// the accesses coalesce; the walk over tokens is sequential per column, which costs
// count x hidden reads but keeps the summation order fixed whatever the launch shape.
#include "kernels/cuda/embedding.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

__global__ void embedding_forward_kernel(bf16* out, const int32_t* tokens, const bf16* table, int64_t count,
                                         int64_t hidden) {
  int64_t chunks = hidden / 8;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count * chunks) return;
  int64_t n = i / chunks, c = (i % chunks) * 8;
  *reinterpret_cast<uint4*>(out + n * hidden + c) =
      *reinterpret_cast<const uint4*>(table + static_cast<int64_t>(tokens[n]) * hidden + c);
}

__global__ void embedding_backward_kernel(float* dtable, const bf16* dout, const int32_t* tokens, int64_t count,
                                          int64_t hidden) {
  int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= hidden) return;
  for (int64_t n = 0; n < count; ++n)
    dtable[static_cast<int64_t>(tokens[n]) * hidden + d] += __bfloat162float(dout[n * hidden + d]);
}

}  // namespace

void embedding_forward(bf16* out, const int32_t* tokens, const bf16* table, int64_t count, int64_t hidden) {
  FORGE_CHECK(hidden % 8 == 0, "embedding: hidden {} must be a multiple of 8 on CUDA", hidden);
  int64_t n = count * hidden / 8;
  if (n) embedding_forward_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(out, tokens, table, count, hidden);
  FORGE_CUDA_LAUNCH_CHECK();
}

void embedding_backward(float* dtable, const bf16* dout, const int32_t* tokens, int64_t count, int64_t hidden) {
  if (hidden && count)
    embedding_backward_kernel<<<static_cast<unsigned>((hidden + 127) / 128), 128>>>(dtable, dout, tokens, count,
                                                                                  hidden);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
