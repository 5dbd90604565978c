// [B, R, C] -> [B, C, R] bf16 transposes on the GPU, the NCHW <-> NHWC changes at the VAE's
// edges (ops/image_layout.h). The classic tiled transpose: a block of 32 x 8 threads moves
// a 32 x 32 tile through shared memory (one column of padding against bank conflicts), so
// both the reads and the writes are runs of 32 consecutive elements. An image has 3
// channels and a latent 16 or 32: most tiles are partly empty along C, which costs a little
// occupancy on a pass that runs once per image.
#include "kernels/cuda/image_layout.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kTile = 32;
constexpr int kRowsPerPass = 8;

// out[b, j, i] = in[b, i, j] for in [batch, rows, cols]; grid (tiles, batch), the tiles
// numbered row-major over (row tile, column tile): a million pixels are 32768 row tiles, more
// than a grid's y dimension takes.
__global__ void transpose_kernel(bf16* out, const bf16* in, int64_t rows, int64_t cols, int64_t col_tiles) {
  __shared__ bf16 tile[kTile][kTile + 1];
  const int64_t b = blockIdx.y;
  const int64_t row0 = blockIdx.x / col_tiles * kTile, col0 = blockIdx.x % col_tiles * kTile;
  const bf16* src = in + b * rows * cols;
  bf16* dst = out + b * rows * cols;
  for (int r = threadIdx.y; r < kTile; r += kRowsPerPass) {
    const int64_t i = row0 + r, j = col0 + threadIdx.x;
    if (i < rows && j < cols) tile[r][threadIdx.x] = src[i * cols + j];
  }
  __syncthreads();
  for (int r = threadIdx.y; r < kTile; r += kRowsPerPass) {
    const int64_t j = col0 + r, i = row0 + threadIdx.x;
    if (i < rows && j < cols) dst[j * rows + i] = tile[threadIdx.x][r];
  }
}

void transpose(bf16* out, const bf16* in, int64_t batch, int64_t rows, int64_t cols) {
  if (batch * rows * cols == 0) return;
  const int64_t col_tiles = (cols + kTile - 1) / kTile, row_tiles = (rows + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(row_tiles * col_tiles), static_cast<unsigned>(batch));
  transpose_kernel<<<grid, dim3(kTile, kRowsPerPass)>>>(out, in, rows, cols, col_tiles);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void nhwc_from_nchw(bf16* out, const bf16* in, int64_t batch, int64_t channels, int64_t pixels) {
  transpose(out, in, batch, channels, pixels);
}

void nchw_from_nhwc(bf16* out, const bf16* in, int64_t batch, int64_t channels, int64_t pixels) {
  transpose(out, in, batch, pixels, channels);
}

}  // namespace forge::cuda
