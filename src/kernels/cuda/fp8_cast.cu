// bf16 -> FP8 casts with a scale held on the device, the amax reductions that produce the
// scale, and the cast that also writes the transpose (NOTE [FP8 scaling recipes] in
// kernels/cpu/fp8_scaling.h, whose CPU functions these equal bit for bit).
//
// Cast: out = cvt.rn.satfinite(clamp(x * scale, -max, max)), the fp32 product rounded once
// (__fmul_rn, as torchao's tensor.to(float32) * scale), clamped to the largest finite as
// torchao's to_fp8_saturated does (infinities too), and converted by the instruction Hopper
// has for it (__nv_cvt_float_to_fp8 with __NV_SATFINITE): round to nearest even. NaN is
// written as 0x7f | sign explicitly, as the CPU reference does, whatever the instruction's NaN.
// Memory-bound: 2 bytes read and 1 written per element. Each thread takes 8 consecutive
// elements (one 16-byte load, one 8-byte store) when the buffers allow vector access, the
// scalar path otherwise; the format is a template parameter, so the inner loop has no branch.
//
// Amax: every thread keeps the largest |x| it saw as the bits of a non-negative float;
// those order like unsigned integers, and a NaN (exponent all ones, mantissa non-zero)
// compares above +inf, so the integer maximum propagates NaN as torch.max(abs(x)) does.
// A warp reduces with __reduce_max_sync, a block through shared memory, and one atomicMax
// per block lands in the output: fp8_amax zeroes it first (cudaMemsetAsync), the casts fold
// their amax into whatever the output holds (a step's running maximum for delayed scaling).
// The result stays on the device and no step waits for the host.
//
// Cast + transpose: a block owns a 64x64 tile; its 256 threads read the tile row by row
// (consecutive threads on consecutive columns), write the row-major codes at once and
// keep them in shared memory (65 bytes a row, so the column reads of the second phase do
// not all hit one bank), then write the tile's columns as rows of out_t, consecutive
// threads on consecutive bytes. Tiles at the right and bottom edges are partial. This is
// the plain version, one element per thread per access, kept for shapes that are not whole
// tiles: on the 8B-shape proxy it was estimated, from the profiled casts' traffic, near
// 0.9 TB/s (docs/PERF.md, "FP8 on the GPU").
//
// Whole tiles take the vector version (rows and cols multiples of 64, x 16-byte aligned,
// the outputs 8-byte aligned): a 64x64 tile, each thread loading 8 consecutive bf16 (one
// 16-byte load; 8 threads cover a 128-byte row segment) and storing their 8 codes at once
// into out (8 bytes) and into the shared tile (two words); then each thread gathers 8
// consecutive rows of one column from the tile and stores them as 8 bytes of out_t, 4
// threads writing one 32-byte sector of an out_t row. The tile's rows are padded to 68
// bytes (17 words, odd): a gathering warp reads 4 row groups x 8 columns, 8 row groups'
// worth of words that land on distinct banks.
#include "kernels/cuda/fp8_cast.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fp8_device.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPerThread = kFp8Vector;  // amax8 / cast8 (fp8_device.cuh)
constexpr int kTile = 64;
constexpr int kTileRowsPerPass = kThreads / kTile;  // 4

__global__ void amax_kernel(const bf16* x, int64_t n, float* amax, bool vector_ok) {
  unsigned mine = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * kPerThread;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread; first < n;
       first += stride)
    amax8(x, first, n, vector_ok, mine);
  block_max_into(mine, amax);
}

// torchao's amax_to_scale (scale_from_amax in fp8_device.cuh).
__global__ void scale_from_amax_kernel(const float* amax, float fp8_max, bool power_of_2, float* scale,
                                       float* scale_inv, float* seen) {
  const float a = *amax;
  if (seen) atomicMax(reinterpret_cast<unsigned*>(seen), abs_bits(a));
  const float s = scale_from_amax(a, fp8_max, power_of_2);
  *scale = s;
  *scale_inv = 1.0f / s;
}

template <Fp8Format F>
__global__ void cast_kernel(const bf16* x, int64_t n, const float* scale_ptr, uint8_t* out, float* amax,
                            bool vector_ok) {
  const float scale = *scale_ptr;
  unsigned mine = 0;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread;
  if (first < n) cast8<F>(x, first, n, scale, out, vector_ok, mine);
  if (amax) block_max_into(mine, amax);
}

template <Fp8Format F>
__global__ void cast_transpose_kernel(const bf16* x, int64_t rows, int64_t cols, const float* scale_ptr, uint8_t* out,
                                      uint8_t* out_t, float* amax) {
  __shared__ uint8_t tile[kTile][kTile + 1];
  const float scale = *scale_ptr;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tx = threadIdx.x % kTile, ty = threadIdx.x / kTile;
  unsigned mine = 0;
  for (int r = ty; r < kTile; r += kTileRowsPerPass) {
    const int64_t row = row0 + r, col = col0 + tx;
    if (row < rows && col < cols) {
      const float v = __bfloat162float(x[row * cols + col]);
      mine = max(mine, abs_bits(v));
      const uint8_t code = cast_saturated<F>(__fmul_rn(v, scale));
      if (out) out[row * cols + col] = code;
      tile[r][tx] = code;
    }
  }
  if (out_t) {
    __syncthreads();
    for (int c = ty; c < kTile; c += kTileRowsPerPass) {
      const int64_t col = col0 + c, row = row0 + tx;  // out_t[col][row]
      if (col < cols && row < rows) out_t[col * rows + row] = tile[tx][c];
    }
  }
  if (amax) block_max_into(mine, amax);
}

constexpr int kTileStride = kTile + 4;  // bytes per row of the vector kernel's shared tile

template <Fp8Format F>
__global__ void cast_transpose_vector_kernel(const bf16* x, int64_t rows, int64_t cols, const float* scale_ptr,
                                             uint8_t* out, uint8_t* out_t, float* amax) {
  __shared__ __align__(16) uint8_t tile[kTile * kTileStride];
  const float scale = *scale_ptr;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * kTile, col0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int t = threadIdx.x;
  unsigned mine = 0;
  // Load and cast: 32 rows x 8 chunks of 8 per pass.
  const int chunk = (t % 8) * 8;
#pragma unroll
  for (int pass = 0; pass < 2; ++pass) {
    const int r = pass * 32 + t / 8;
    const int64_t at = (row0 + r) * cols + col0 + chunk;
    const uint4 packed = *reinterpret_cast<const uint4*>(x + at);
    const bf16* values = reinterpret_cast<const bf16*>(&packed);
    uint2 codes;
    uint8_t* bytes = reinterpret_cast<uint8_t*>(&codes);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float v = __bfloat162float(values[k]);
      mine = max(mine, abs_bits(v));
      bytes[k] = cast_saturated<F>(__fmul_rn(v, scale));
    }
    if (out) *reinterpret_cast<uint2*>(out + at) = codes;
    unsigned* slot = reinterpret_cast<unsigned*>(tile + r * kTileStride + chunk);
    slot[0] = codes.x;
    slot[1] = codes.y;
  }
  if (out_t) {
    __syncthreads();
    // Gather: a warp takes 8 columns x 4 groups of 8 rows; two passes cover the 64 rows.
    const int c = (t / 32) * 8 + t % 8;
#pragma unroll
    for (int pass = 0; pass < 2; ++pass) {
      const int g = pass * 4 + (t % 32) / 8;
      uint2 codes;
      uint8_t* bytes = reinterpret_cast<uint8_t*>(&codes);
#pragma unroll
      for (int j = 0; j < 8; ++j) bytes[j] = tile[(g * 8 + j) * kTileStride + c];
      *reinterpret_cast<uint2*>(out_t + (col0 + c) * rows + row0 + g * 8) = codes;
    }
  }
  if (amax) block_max_into(mine, amax);
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

unsigned blocks_for(int64_t n) {
  return static_cast<unsigned>((n + kThreads * kPerThread - 1) / (kThreads * kPerThread));
}

}  // namespace

void fp8_amax_reset(float* amax) { CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float))); }

void fp8_amax(const bf16* x, int64_t n, float* amax) {
  fp8_amax_reset(amax);
  if (n == 0) return;
  // Enough blocks to fill the GPU a few times over; each thread strides through the rest.
  const unsigned blocks = std::min(blocks_for(n), 132u * 16u);
  amax_kernel<<<blocks, kThreads>>>(x, n, amax, aligned(x, 16));
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_scale_from_amax(const float* amax, Fp8Format format, bool power_of_2, float* scale, float* scale_inv,
                         float* seen) {
  scale_from_amax_kernel<<<1, 1>>>(amax, cpu::fp8_max(format), power_of_2, scale, scale_inv, seen);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_cast(const bf16* x, int64_t n, const float* scale, Fp8Format format, uint8_t* out, float* amax) {
  if (n == 0) return;
  const bool vector_ok = aligned(x, 16) && aligned(out, 8);
  if (format == Fp8Format::E4M3)
    cast_kernel<Fp8Format::E4M3><<<blocks_for(n), kThreads>>>(x, n, scale, out, amax, vector_ok);
  else
    cast_kernel<Fp8Format::E5M2><<<blocks_for(n), kThreads>>>(x, n, scale, out, amax, vector_ok);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_cast_transpose(const bf16* x, int64_t rows, int64_t cols, const float* scale, Fp8Format format,
                        uint8_t* out, uint8_t* out_t, float* amax) {
  if (rows == 0 || cols == 0) return;
  FORGE_CHECK((rows + kTile - 1) / kTile <= 65535, "fp8_cast_transpose: {} rows exceed the grid's {} tiles of {}",
              rows, 65535, kTile);
  const dim3 grid(static_cast<unsigned>((cols + kTile - 1) / kTile), static_cast<unsigned>((rows + kTile - 1) / kTile));
  const bool whole_tiles = rows % kTile == 0 && cols % kTile == 0 && aligned(x, 16) && (!out || aligned(out, 8)) &&
                           (!out_t || aligned(out_t, 8));
  if (whole_tiles && format == Fp8Format::E4M3)
    cast_transpose_vector_kernel<Fp8Format::E4M3><<<grid, kThreads>>>(x, rows, cols, scale, out, out_t, amax);
  else if (whole_tiles)
    cast_transpose_vector_kernel<Fp8Format::E5M2><<<grid, kThreads>>>(x, rows, cols, scale, out, out_t, amax);
  else if (format == Fp8Format::E4M3)
    cast_transpose_kernel<Fp8Format::E4M3><<<grid, kThreads>>>(x, rows, cols, scale, out, out_t, amax);
  else
    cast_transpose_kernel<Fp8Format::E5M2><<<grid, kThreads>>>(x, rows, cols, scale, out, out_t, amax);
  FORGE_CUDA_LAUNCH_CHECK();
}


}  // namespace forge::cuda
