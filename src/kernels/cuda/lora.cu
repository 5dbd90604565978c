// LoRA's two small kernels (NOTE [LoRA linear] in ops/lora.h).
// Dropout: one thread per element, the keep decision an integer hash of (seed, index)
// (kernels/lora_dropout_mask.h), so the CPU reference, a recomputation under activation
// checkpointing and the backward all see the same mask with nothing stored. Memory-bound
// and a fraction of the step; kept simple.
// Block mask: the fused adapter's B gradient [out, parts * rank] is computed by one GEMM
// over all of its columns; this zeroes the entries outside each module's rows, which the
// module's B does not have. The matrix is small (out × parts × rank).
#include "kernels/cuda/lora.h"

#include "core/error.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/lora_dropout_mask.h"

namespace forge::cuda {
namespace {

struct Blocks {
  int64_t begin[kMaxLoraBlocks];
  int64_t end[kMaxLoraBlocks];
};

__global__ void lora_dropout_kernel(bf16* out, const bf16* in, int64_t n, uint32_t threshold, float keep_scale,
                                    uint64_t seed, bool accumulate) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = lora_keep(seed, i, threshold) ? __bfloat162float(in[i]) * keep_scale : 0.0f;
  if (accumulate) v += __bfloat162float(out[i]);
  out[i] = __float2bfloat16(v);
}

__global__ void lora_mask_blocks_kernel(float* b, int64_t rows, int64_t rank, int blocks, Blocks bounds) {
  int64_t cols = rank * blocks;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * cols) return;
  int64_t o = i / cols, k = (i % cols) / rank;
  if (o < bounds.begin[k] || o >= bounds.end[k]) b[i] = 0.0f;
}

unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

}  // namespace

void lora_dropout(bf16* out, const bf16* in, int64_t n, float p, uint64_t seed, bool accumulate) {
  if (n) lora_dropout_kernel<<<blocks_for(n, 256), 256>>>(out, in, n, lora_dropout_threshold(p), 1.0f / (1.0f - p),
                                                          seed, accumulate);
  FORGE_CUDA_LAUNCH_CHECK();
}

void lora_mask_blocks(float* b, int64_t rows, int64_t rank, int blocks, const int64_t* row_begin,
                      const int64_t* row_end) {
  FORGE_CHECK(blocks >= 1 && blocks <= kMaxLoraBlocks, "lora_mask_blocks: {} blocks (at most {})", blocks,
              kMaxLoraBlocks);
  Blocks bounds{};
  for (int k = 0; k < blocks; ++k) {
    bounds.begin[k] = row_begin[k];
    bounds.end[k] = row_end[k];
  }
  const int64_t n = rows * rank * blocks;
  if (n) lora_mask_blocks_kernel<<<blocks_for(n, 256), 256>>>(b, rows, rank, blocks, bounds);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
