// Ring attention's log-sum-exp merge on the GPU (NOTE [Attention merge] in
// ops/attention_merge.h). One warp per query row (batch, position, head): every lane reads
// the row's two lse values and computes the two weights, the lanes stride over the head dim
// (out fp32, the partial out bf16), and lane 0 writes the merged lse once every lane has read
// the old one (a __syncwarp between). The statistics are [b, h, l], or token-major [b l, h]
// (cuDNN's ragged statistics, packed examples), where the row's index is the lse's.
// Memory-bound: it reads and writes the fp32 out once per ring step, next to the attention's
// reads of the same rows.
#include "kernels/cuda/attention_merge.h"

#include <cuda_bf16.h>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kWarps = 8;

__global__ void attention_merge_kernel(float* out, float* lse, const bf16* part_out, const float* part_lse,
                                       int64_t b, int64_t l, int64_t h, int64_t d, bool token_major) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;  // (bi, i, hi)
  if (row >= b * l * h) return;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t hi = row % h, i = (row / h) % l, bi = row / (h * l);
  const int64_t stat = token_major ? row : (bi * h + hi) * l + i;
  const float running = lse[stat], other = part_lse[stat];
  if (other == -INFINITY) return;
  const float m = fmaxf(running, other);
  const float merged = running == -INFINITY ? other : m + logf(expf(running - m) + expf(other - m));
  const float keep = running == -INFINITY ? 0.0f : expf(running - merged), add = expf(other - merged);
  float* o = out + row * d;
  const bf16* p = part_out + row * d;
  for (int64_t k = lane; k < d; k += 32) o[k] = keep * o[k] + add * __bfloat162float(p[k]);
  __syncwarp();
  if (lane == 0) lse[stat] = merged;
}

__global__ void attention_lse_none_kernel(float* lse, int64_t rows, int64_t l, int64_t from) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x, width = l - from;
  if (i < rows * width) lse[(i / width) * l + from + i % width] = -INFINITY;
}

}  // namespace

void attention_lse_none(float* lse, int64_t rows, int64_t l, int64_t from) {
  const int64_t n = rows * (l - from);
  if (n <= 0) return;
  attention_lse_none_kernel<<<static_cast<unsigned>((n + 255) / 256), 256>>>(lse, rows, l, from);
  FORGE_CUDA_LAUNCH_CHECK();
}

void attention_merge(float* out, float* lse, const bf16* part_out, const float* part_lse, int64_t b, int64_t l,
                     int64_t h, int64_t d, bool token_major) {
  const int64_t rows = b * l * h;
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  attention_merge_kernel<<<blocks, kWarps * 32>>>(out, lse, part_out, part_lse, b, l, h, d, token_major);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
