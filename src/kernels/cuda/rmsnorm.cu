// RMSNorm on the GPU, bf16 activations with fp32 statistics.
//
// Both directions keep a row in registers between its reduction and its output pass, so
// every input comes from device memory once. A row is dim / 8 vectors of 16 bytes (8 bf16);
// `row_threads` threads share it (a power of two up to a warp, else a multiple of 32 up to
// 256), each holding V vectors, V = 1, 2, 4 or 8 as a template argument so the arrays stay
// in registers. Thread t of the row holds vectors t, t + row_threads, ...: every load is
// 16 bytes wide and coalesced. row_layout() picks the smallest V up to 4 that spreads a row
// over at most 128 threads, else V = 4 on up to 256, else V = 8: dim 4096 -> V = 4 on 128
// threads, 8192 -> V = 4 on 256, 16384 -> V = 8 on 256. A block of up to 256 threads holds
// 256 / row_threads rows. The row sum is a butterfly of shuffles in each warp and, for rows
// wider than a warp, the warps' sums through shared memory in a fixed order. A row wider
// than 8 * 256 vectors (dim > 16384) is covered in several `slabs`; then only the last slab
// stays in registers and the others are read again, from L2.
//
// Forward: rstd = 1 / sqrt(mean(x^2) + eps), y = x * rstd * w; one row per row group.
// Bytes for [8192, 4096]: read x, write y, 67 MB each: 134 MB, 0.045 ms at 3.0 TB/s.
// With an FP8 epilogue (NOTE [FP8 fused producers] in ops/fp8_linear.h) each thread also
// keeps the largest |y| of what it wrote, as y was rounded to bf16, and with codes asked
// writes y's E4M3 codes beside y (8 bytes per vector); the block folds its maximum into
// the amax at the end: the amax pass (or the cast) of the projection that reads y next is
// done here, for 33 MB more written at most.
//
// Backward, with r = rstd: dx += r w dy - x r^3 mean(w dy x), dweight += sum over rows of
// dy x r, both ACCUMULATED. One fused kernel: a row's dy, x and old dx are all loaded (in
// flight together) before its row sum, and written back as dx after it. dweight's column
// sums ride along in registers: each block takes a fixed range of rows (about 264 blocks,
// two per H100 SM), every thread owns the same columns for all of them and sums dy x r
// there in fp32. At the end the block folds its row groups' sums in shared memory and
// writes one partial row to scratch (kernels/cuda/scratch.h); a second kernel adds the
// partial rows in a fixed order into the fp32 dweight. No float atomics, and a partition
// that depends on rows and dim only: the result is deterministic. (Rows in slabs add their
// sums to the block's partial row in place instead.) Bytes for [8192, 4096]: read dy, x, dx
// and write dx, 67 MB each, plus 256 partial rows of 16 KB written and read back, 8 MB:
// 277 MB, 0.092 ms at 3.0 TB/s.
//
// Assumes dim is a multiple of 8 (every Llama-family hidden size is).
#include "kernels/cuda/rmsnorm.h"

#include <algorithm>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fp8_device.cuh"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kBlockThreads = 256;         // most threads in a block; it holds kBlockThreads / row_threads rows
constexpr int kPreferredRowThreads = 128;  // row_layout() prefers a V that spreads a row over at most this many threads
constexpr int kMaxVectors = 8;             // 16-byte vectors a thread holds per slab
constexpr int kBackwardBlocks = 264;       // about this many backward blocks (= dweight partial rows): 2 per H100 SM
constexpr int kSumColumns = 32;            // columns per block of the partial-row sum
constexpr int kSumLanes = 8;               // threads sharing one column there, each over every 8th partial row

// Vector (slab * V + i) * row_threads + t of a row into v[i], zero past the row's end or
// for an inactive row (zeros add nothing to the sums).
template <int V>
__device__ __forceinline__ void load_slab(uint4 (&v)[V], const uint4* row, int slab, int t, int row_threads,
                                          int vectors, bool active) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    int c = (slab * V + i) * row_threads + t;
    v[i] = active && c < vectors ? row[c] : make_uint4(0, 0, 0, 0);
  }
}

// The sum of v over each row group's row_threads threads, returned to all of them. Groups
// narrower than a warp are aligned powers of two, so the butterfly never crosses them, and
// every lane ends with the same bits. Wider groups add their warps' sums from `slots` (one
// float per warp of the block) in a fixed order. Every thread of the block must call it.
__device__ float row_sum(float v, int row_threads, float* slots) {
  for (int o = min(row_threads, kWarp) / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (row_threads <= kWarp) return v;
  if (threadIdx.x % kWarp == 0) slots[threadIdx.x / kWarp] = v;
  __syncthreads();
  const int warps = row_threads / kWarp;
  const float* group = slots + threadIdx.x / row_threads * warps;
  float s = 0.f;
  for (int i = 0; i < warps; ++i) s += group[i];
  return s;
}

template <int V>
__global__ void __launch_bounds__(kBlockThreads)
    rmsnorm_forward_kernel(bf16* y, float* rstd, const bf16* x, const bf16* w, int64_t rows, int dim,
                           int row_threads, int slabs, float eps, Fp8Epilogue fp8) {
  __shared__ float slots[kBlockThreads / kWarp];
  const int vectors = dim / 8, t = threadIdx.x % row_threads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / row_threads) + threadIdx.x / row_threads;
  const bool active = row < rows;
  const int64_t offset = (active ? row : 0) * vectors;
  const uint4* xr = reinterpret_cast<const uint4*>(x) + offset;
  uint4* yr = reinterpret_cast<uint4*>(y) + offset;
  const uint4* wv = reinterpret_cast<const uint4*>(w);

  uint4 v[V];
  float ss = 0.f;
  unsigned amax_bits = 0;
  for (int s = 0; s < slabs; ++s) {
    load_slab<V>(v, xr, s, t, row_threads, vectors, active);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      float f[8];
      unpack8(v[i], f);
#pragma unroll
      for (int k = 0; k < 8; ++k) ss += f[k] * f[k];
    }
  }
  ss = row_sum(ss, row_threads, slots);
  const float r = rsqrtf(ss / dim + eps);
  if (active && t == 0) rstd[row] = r;

  for (int s = slabs - 1; s >= 0; --s) {  // the last slab read is still in v
    if (s != slabs - 1) load_slab<V>(v, xr, s, t, row_threads, vectors, active);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = (s * V + i) * row_threads + t;
      if (!active || c >= vectors) continue;
      float f[8], g[8];
      unpack8(v[i], f);
      unpack8(__ldg(wv + c), g);
#pragma unroll
      for (int k = 0; k < 8; ++k) f[k] = f[k] * r * g[k];
      const uint4 out = pack8(f);
      yr[c] = out;
      if (fp8.amax) fp8_epilogue8(fp8, out, (offset + c) * 8, amax_bits);
    }
  }
  if (fp8.amax) block_max_into(amax_bits, fp8.amax);
}

// One block per fixed range of rows [blockIdx.x * rows_per_part, ...); its row groups walk
// the range in steps of one row each. partial is [gridDim.x, dim]. V <= 4 is held to 128
// registers (no spills), so two blocks of 256 threads share an SM.
template <int V>
__global__ void __launch_bounds__(kBlockThreads, V < kMaxVectors ? 2 : 1)
    rmsnorm_backward_kernel(bf16* dx, float* partial, const bf16* dy, const bf16* x, const bf16* w,
                            const float* rstd, int64_t rows, int dim, int row_threads, int slabs,
                            int64_t rows_per_part) {
  __shared__ float slots[2][kBlockThreads / kWarp];  // alternate steps use alternate halves: one barrier per step
  __shared__ float4 fold[kBlockThreads / 2][2];      // 8 partial sums per thread of the folded-in groups
  const int vectors = dim / 8, t = threadIdx.x % row_threads, group = threadIdx.x / row_threads;
  const int groups = blockDim.x / row_threads;
  const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_part;
  const int64_t end = min(rows, begin + rows_per_part);
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  float* part = partial + static_cast<int64_t>(blockIdx.x) * dim;

  float acc[V][8] = {};  // sum of dy x r over this group's rows, columns of the vectors this thread holds
  int parity = 0;
  for (int64_t first = begin; first < end; first += groups, parity ^= 1) {
    const int64_t row = first + group;
    const bool active = row < end;
    const int64_t offset = (active ? row : 0) * vectors;
    const uint4* xr = reinterpret_cast<const uint4*>(x) + offset;
    const uint4* dyr = reinterpret_cast<const uint4*>(dy) + offset;
    uint4* dxr = reinterpret_cast<uint4*>(dx) + offset;
    const float r = active ? rstd[row] : 0.f;

    uint4 xv[V], dyv[V], dxv[V];
    float dot = 0.f;  // sum of w dy x over the row
    for (int s = 0; s < slabs; ++s) {
      load_slab<V>(xv, xr, s, t, row_threads, vectors, active);
      load_slab<V>(dyv, dyr, s, t, row_threads, vectors, active);
      load_slab<V>(dxv, dxr, s, t, row_threads, vectors, active);  // used after the row sum; wanted in flight now
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int c = (s * V + i) * row_threads + t;
        float fx[8], fy[8], fw[8];
        unpack8(xv[i], fx);
        unpack8(dyv[i], fy);
        unpack8(c < vectors ? __ldg(wv + c) : make_uint4(0, 0, 0, 0), fw);
#pragma unroll
        for (int k = 0; k < 8; ++k) dot += fw[k] * fy[k] * fx[k];
      }
    }
    dot = row_sum(dot, row_threads, slots[parity]);
    const float correction = dot * r * r * r / dim;

    for (int s = slabs - 1; s >= 0; --s) {  // the last slab read is still in registers
      if (s != slabs - 1) {
        load_slab<V>(xv, xr, s, t, row_threads, vectors, active);
        load_slab<V>(dyv, dyr, s, t, row_threads, vectors, active);
        load_slab<V>(dxv, dxr, s, t, row_threads, vectors, active);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int c = (s * V + i) * row_threads + t;
        if (!active || c >= vectors) continue;
        float fx[8], fy[8], fw[8], fd[8];
        unpack8(xv[i], fx);
        unpack8(dyv[i], fy);
        unpack8(__ldg(wv + c), fw);
        unpack8(dxv[i], fd);
#pragma unroll
        for (int k = 0; k < 8; ++k) fd[k] += fw[k] * fy[k] * r - fx[k] * correction;
        dxr[c] = pack8(fd);
        if (slabs == 1) {
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[i][k] += fy[k] * fx[k] * r;
        } else {  // one group per block here, so this thread alone adds to these columns
          float4* p = reinterpret_cast<float4*>(part) + 2 * c;
          float4 lo = first == begin ? make_float4(0.f, 0.f, 0.f, 0.f) : p[0];
          float4 hi = first == begin ? make_float4(0.f, 0.f, 0.f, 0.f) : p[1];
          lo.x += fy[0] * fx[0] * r, lo.y += fy[1] * fx[1] * r, lo.z += fy[2] * fx[2] * r, lo.w += fy[3] * fx[3] * r;
          hi.x += fy[4] * fx[4] * r, hi.y += fy[5] * fx[5] * r, hi.z += fy[6] * fx[6] * r, hi.w += fy[7] * fx[7] * r;
          p[0] = lo;
          p[1] = hi;
        }
      }
    }
  }
  if (slabs != 1) return;  // uniform over the block: the sums are already in part

  // Fold the groups' sums into group 0, a tree in a fixed order: at each stride, group
  // g + stride hands its sums to group g (g a multiple of 2 * stride), one vector at a time.
  for (int stride = 1; stride < groups; stride *= 2) {
    const bool sends = group % (2 * stride) == stride;
    const bool receives = group % (2 * stride) == 0 && group + stride < groups;
    float4* slot = fold[group / (2 * stride) * row_threads + t];
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (sends) {
        slot[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
        slot[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
      }
      __syncthreads();
      if (receives) {
        const float4 lo = slot[0], hi = slot[1];
        acc[i][0] += lo.x, acc[i][1] += lo.y, acc[i][2] += lo.z, acc[i][3] += lo.w;
        acc[i][4] += hi.x, acc[i][5] += hi.y, acc[i][6] += hi.z, acc[i][7] += hi.w;
      }
      __syncthreads();
    }
  }
  if (group != 0) return;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int c = i * row_threads + t;
    if (c >= vectors) continue;
    float4* p = reinterpret_cast<float4*>(part) + 2 * c;
    p[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    p[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
  }
}

// out[d] += the sum of partial[p, d] over p. Thread (column, lane) adds every kSumLanes-th
// partial row from `lane` on; the lanes' sums are then added in lane order.
__global__ void __launch_bounds__(kSumColumns * kSumLanes)
    sum_partials_kernel(float* out, const float* partial, int parts, int dim) {
  __shared__ float lane_sums[kSumLanes][kSumColumns];
  const int d = blockIdx.x * kSumColumns + threadIdx.x;
  float s = 0.f;
  if (d < dim) {
#pragma unroll 8
    for (int p = threadIdx.y; p < parts; p += kSumLanes) s += partial[static_cast<int64_t>(p) * dim + d];
  }
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || d >= dim) return;
  float total = out[d];
  for (int j = 0; j < kSumLanes; ++j) total += lane_sums[j][threadIdx.x];
  out[d] = total;
}

// How a row of `dim` columns is spread over threads (see the top of the file).
struct RowLayout {
  int vectors_per_thread;  // V, per slab
  int row_threads;
  int rows_per_block;
  int slabs;
};

RowLayout row_layout(int64_t dim) {
  const int64_t vectors = dim / 8;
  int v = 1;
  while (v < kMaxVectors / 2 && (vectors + v - 1) / v > kPreferredRowThreads) v *= 2;
  if ((vectors + v - 1) / v > kBlockThreads) v = kMaxVectors;
  const int64_t needed = (vectors + v - 1) / v;
  int row_threads = 1;
  if (needed <= kWarp) {
    while (row_threads < needed) row_threads *= 2;
  } else {
    row_threads = static_cast<int>(std::min<int64_t>((needed + kWarp - 1) / kWarp * kWarp, kBlockThreads));
  }
  const int64_t per_slab = static_cast<int64_t>(v) * row_threads;
  return {v, row_threads, kBlockThreads / row_threads, static_cast<int>((vectors + per_slab - 1) / per_slab)};
}

}  // namespace

void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* weight, int64_t rows, int64_t dim, float eps,
                     const Fp8Epilogue& fp8) {
  FORGE_CHECK(dim % 8 == 0, "rmsnorm: dim {} must be a multiple of 8 on CUDA", dim);
  if (rows == 0) return;
  const RowLayout l = row_layout(dim);
  const unsigned grid = static_cast<unsigned>((rows + l.rows_per_block - 1) / l.rows_per_block);
  const unsigned block = static_cast<unsigned>(l.rows_per_block * l.row_threads);
  const int d = static_cast<int>(dim);
  switch (l.vectors_per_thread) {
    case 1: rmsnorm_forward_kernel<1><<<grid, block>>>(y, rstd, x, weight, rows, d, l.row_threads, l.slabs, eps, fp8); break;
    case 2: rmsnorm_forward_kernel<2><<<grid, block>>>(y, rstd, x, weight, rows, d, l.row_threads, l.slabs, eps, fp8); break;
    case 4: rmsnorm_forward_kernel<4><<<grid, block>>>(y, rstd, x, weight, rows, d, l.row_threads, l.slabs, eps, fp8); break;
    default: rmsnorm_forward_kernel<8><<<grid, block>>>(y, rstd, x, weight, rows, d, l.row_threads, l.slabs, eps, fp8);
  }
  FORGE_CUDA_LAUNCH_CHECK();
}

void rmsnorm_backward(bf16* dx, float* dweight, const bf16* dy, const bf16* x, const bf16* weight,
                      const float* rstd, int64_t rows, int64_t dim) {
  FORGE_CHECK(dim % 8 == 0, "rmsnorm: dim {} must be a multiple of 8 on CUDA", dim);
  if (rows == 0 || dim == 0) return;
  const RowLayout l = row_layout(dim);
  // Blocks take whole steps (one row per group) and about kBackwardBlocks of them cover the
  // rows; the split depends on rows and dim only, never on the device.
  const int64_t steps = (rows + l.rows_per_block - 1) / l.rows_per_block;
  const int64_t rows_per_part = (steps + kBackwardBlocks - 1) / kBackwardBlocks * l.rows_per_block;
  const int parts = static_cast<int>((rows + rows_per_part - 1) / rows_per_part);
  float* partial = static_cast<float*>(scratch_buffer(ScratchSlot::RmsnormPartials, sizeof(float) * parts * dim));
  const unsigned block = static_cast<unsigned>(l.rows_per_block * l.row_threads);
  const unsigned grid = static_cast<unsigned>(parts);
  const int d = static_cast<int>(dim);
  switch (l.vectors_per_thread) {
    case 1:
      rmsnorm_backward_kernel<1><<<grid, block>>>(dx, partial, dy, x, weight, rstd, rows, d, l.row_threads, l.slabs,
                                                  rows_per_part);
      break;
    case 2:
      rmsnorm_backward_kernel<2><<<grid, block>>>(dx, partial, dy, x, weight, rstd, rows, d, l.row_threads, l.slabs,
                                                  rows_per_part);
      break;
    case 4:
      rmsnorm_backward_kernel<4><<<grid, block>>>(dx, partial, dy, x, weight, rstd, rows, d, l.row_threads, l.slabs,
                                                  rows_per_part);
      break;
    default:
      rmsnorm_backward_kernel<8><<<grid, block>>>(dx, partial, dy, x, weight, rstd, rows, d, l.row_threads, l.slabs,
                                                  rows_per_part);
  }
  FORGE_CUDA_LAUNCH_CHECK();
  sum_partials_kernel<<<static_cast<unsigned>((dim + kSumColumns - 1) / kSumColumns), dim3(kSumColumns, kSumLanes)>>>(
      dweight, partial, parts, d);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
