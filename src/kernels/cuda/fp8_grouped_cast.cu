// NOTE [FP8 grouped expert casts]
// The routed experts' FP8 GEMMs (NOTE [FP8 routed experts] in ops/moe_fp8.h) quantize each
// expert's block of rows of the permuted token matrix with a scale of its own. Done expert
// by expert that is three launches per expert and GEMM (amax, scale, cast), 64 experts x
// several GEMMs per micro-batch on a DeepSeek-V2-Lite-shaped model: thousands of kernels
// of a few microseconds each, most of them far too small to fill the GPU. These kernels do
// the same for every group of rows at once, in three launches whatever the number of
// experts (four with the amax reset):
//   fp8_grouped_amax             grid (blocks per group, groups): block (b, g) strides through
//                                group g's rows (one contiguous range of the row-major
//                                matrix) and folds its maximum into amax[g] as fp8_amax does;
//   fp8_grouped_scale_from_amax  one thread per group: the scale and its inverse from the
//                                group's amax, folding it into the group's `seen`;
//   fp8_grouped_cast             the same grid as the amax: each element cast with its group's
//                                scale, each group's codes row-major from a 256-byte boundary
//                                (fp8_grouped_codes_at: where cuBLASLt assumes an FP8 GEMM's
//                                operand starts), the group's amax folded where asked (delayed).
// The group boundaries are read on the device (the routing's offsets, I64 [groups + 1]);
// the host only says how many rows the largest group may have, which sizes the grid.
// Bit for bit the per-expert path: the amax is a maximum (the same whatever order the
// blocks fold it in; NaN wins through the integer comparison of fp8_device.cuh), the scale
// is scale_from_amax of fp8_device.cuh on the same amax, and every code is cast_saturated of
// the same product __fmul_rn(x, scale) that fp8_cast computes, vector or scalar path alike.
// A group without rows is not touched at all (no amax reset, no scale, no fold into its
// `seen`), as the per-expert path runs nothing for an expert without rows.
// Memory traffic is the per-expert path's (one read of x for the amax, one read and one
// 1-byte write for the cast); what goes is the launches and the tail of each small grid.
// GpuFp8GroupedCast checks amaxes, scales, `seen` and codes against fp8_amax /
// fp8_scale_from_amax / fp8_cast per group and against the CPU reference.
#include "kernels/cuda/fp8_grouped_cast.h"

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>

#include "core/error.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fp8_device.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kPerThread = kFp8Vector;  // amax8 / cast8 (fp8_device.cuh)

// Group g's rows [begin, end).
struct GroupRows {
  int64_t begin, end;
};

__device__ __forceinline__ GroupRows group_rows(const int64_t* offsets, int64_t rows_per_group, int64_t g) {
  if (offsets) return {offsets[g], offsets[g + 1]};
  return {g * rows_per_group, (g + 1) * rows_per_group};
}

__device__ __forceinline__ bool aligned_to(const void* p, unsigned bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

__global__ void reset_kernel(const int64_t* offsets, int64_t rows_per_group, int64_t groups, float* amax,
                             int64_t stride) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const GroupRows r = group_rows(offsets, rows_per_group, g);
  if (r.begin != r.end) amax[g * stride] = 0.0f;
}

__global__ void grouped_amax_kernel(const bf16* x, const int64_t* offsets, int64_t rows_per_group, int64_t cols,
                                    float* amax, int64_t stride) {
  const int64_t g = blockIdx.y;
  const GroupRows r = group_rows(offsets, rows_per_group, g);
  if (r.begin == r.end) return;  // the whole block: no barrier is reached
  const bf16* xg = x + r.begin * cols;
  const int64_t n = (r.end - r.begin) * cols;
  const bool vector_ok = aligned_to(xg, 16);
  unsigned mine = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kPerThread;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread; first < n;
       first += step)
    amax8(xg, first, n, vector_ok, mine);
  block_max_into(mine, amax + g * stride);
}

__global__ void grouped_scale_kernel(const int64_t* offsets, int64_t rows_per_group, int64_t groups,
                                     const float* amax, int64_t amax_stride, float fp8_max, float* scale,
                                     int64_t scale_stride, float* scale_inv, int64_t scale_inv_stride, float* seen,
                                     int64_t seen_stride) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  const GroupRows r = group_rows(offsets, rows_per_group, g);
  if (r.begin == r.end) return;
  const float a = amax[g * amax_stride];
  if (seen) atomicMax(reinterpret_cast<unsigned*>(seen + g * seen_stride), abs_bits(a));
  const float s = scale_from_amax(a, fp8_max, false);
  scale[g * scale_stride] = s;
  scale_inv[g * scale_inv_stride] = 1.0f / s;
}

template <Fp8Format F>
__global__ void grouped_cast_kernel(const bf16* x, const int64_t* offsets, int64_t rows_per_group, int64_t cols,
                                    const float* scales, int64_t scale_stride, uint8_t* out, float* amax,
                                    int64_t amax_stride) {
  const int64_t g = blockIdx.y;
  const GroupRows r = group_rows(offsets, rows_per_group, g);
  if (r.begin == r.end) return;
  const bf16* xg = x + r.begin * cols;
  uint8_t* og = out + fp8_grouped_codes_at(r.begin, cols, g);
  const int64_t n = (r.end - r.begin) * cols;
  const bool vector_ok = aligned_to(xg, 16) && aligned_to(og, 8);
  const float scale = scales[g * scale_stride];
  unsigned mine = 0;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x * kPerThread;
  for (int64_t first = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kPerThread; first < n;
       first += step)
    cast8<F>(xg, first, n, scale, og, vector_ok, mine);
  if (amax) block_max_into(mine, amax + g * amax_stride);
}

void check_groups(const Fp8RowGroups& g, const char* op) {
  FORGE_CHECK(g.groups >= 0 && g.groups <= 65535 && g.cols >= 0 && g.max_rows >= 0,
              "{}: {} groups (at most 65535) of {} columns, the largest {} rows", op, g.groups, g.cols, g.max_rows);
  FORGE_CHECK(g.offsets || g.rows_per_group == g.max_rows,
              "{}: groups of {} rows each, but the largest is said to have {}", op, g.rows_per_group, g.max_rows);
}

// (blocks per group, groups): enough blocks for the largest group, at most about 16 per SM
// over all groups (132 SMs); each block strides through the rest of its group.
dim3 grid_for(const Fp8RowGroups& g) {
  const int64_t most = g.max_rows * g.cols;
  const int64_t needed = (most + kThreads * kPerThread - 1) / (kThreads * kPerThread);
  const int64_t cap = std::max<int64_t>(8, 132 * 16 / std::max<int64_t>(g.groups, 1));
  return dim3(static_cast<unsigned>(std::max<int64_t>(1, std::min(needed, cap))), static_cast<unsigned>(g.groups));
}

unsigned thread_blocks(int64_t groups, int threads) { return static_cast<unsigned>((groups + threads - 1) / threads); }

}  // namespace

void fp8_grouped_amax(const bf16* x, const Fp8RowGroups& groups, Fp8GroupStats amax) {
  check_groups(groups, "fp8_grouped_amax");
  if (groups.groups == 0) return;
  reset_kernel<<<thread_blocks(groups.groups, 128), 128>>>(groups.offsets, groups.rows_per_group, groups.groups,
                                                           amax.base, amax.stride);
  FORGE_CUDA_LAUNCH_CHECK();
  if (groups.max_rows == 0 || groups.cols == 0) return;
  grouped_amax_kernel<<<grid_for(groups), kThreads>>>(x, groups.offsets, groups.rows_per_group, groups.cols, amax.base,
                                                      amax.stride);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_grouped_scale_from_amax(const Fp8RowGroups& groups, Fp8GroupStats amax, Fp8Format format,
                                 Fp8GroupStats scale, Fp8GroupStats scale_inv, Fp8GroupStats seen) {
  check_groups(groups, "fp8_grouped_scale_from_amax");
  if (groups.groups == 0) return;
  grouped_scale_kernel<<<thread_blocks(groups.groups, 128), 128>>>(
      groups.offsets, groups.rows_per_group, groups.groups, amax.base, amax.stride, cpu::fp8_max(format), scale.base,
      scale.stride, scale_inv.base, scale_inv.stride, seen.base, seen.stride);
  FORGE_CUDA_LAUNCH_CHECK();
}

void fp8_grouped_cast(const bf16* x, const Fp8RowGroups& groups, Fp8GroupStats scale, Fp8Format format,
                      uint8_t* out, Fp8GroupStats amax) {
  check_groups(groups, "fp8_grouped_cast");
  if (groups.groups == 0 || groups.max_rows == 0 || groups.cols == 0) return;
  const dim3 grid = grid_for(groups);
  if (format == Fp8Format::E4M3)
    grouped_cast_kernel<Fp8Format::E4M3><<<grid, kThreads>>>(x, groups.offsets, groups.rows_per_group, groups.cols,
                                                             scale.base, scale.stride, out, amax.base, amax.stride);
  else
    grouped_cast_kernel<Fp8Format::E5M2><<<grid, kThreads>>>(x, groups.offsets, groups.rows_per_group, groups.cols,
                                                             scale.base, scale.stride, out, amax.base, amax.stride);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
