// RMSNorm on the GPU, bf16 activations with fp32 statistics.
//
// Forward: one warp per row. Each lane reads 16-byte chunks (8 bf16) of the row, sums
// squares in fp32, the warp reduces with shuffles, and a second pass over the row (hot in
// L1/L2) writes y. rstd is kept in fp32 for the backward.
//
// Backward: dx[d] += r w[d] dy[d] - x[d] r^3 mean_j(w[j] dy[j] x[j]) with r = rstd, again
// one warp per row. dweight[d] = sum_rows dy * x * rstd needs a
// reduction over rows: each block handles a tile of rows (16-byte loads, 8 columns per
// thread) and writes its partial column sums to a scratch buffer (kernels/cuda/scratch.h); a second kernel adds the partials
// in a fixed order, so the result is deterministic (no atomics) and accumulates (+=) into
// the fp32 gradient.
//
// Assumes dim is a multiple of 8 (every Llama-family hidden size is).
#include "kernels/cuda/rmsnorm.h"

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kRowsPerBlock = 8;          // warps per block, one row each
constexpr int kRowsPerPartial = 64;       // rows summed by one block of the dweight reduction
constexpr int kPartialThreads = 64;       // threads of a dweight block, 8 columns each

__device__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void rmsnorm_forward_kernel(bf16* y, float* rstd, const bf16* x, const bf16* w, int64_t rows, int dim,
                                       float eps) {
  int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (row >= rows) return;
  const bf16* xr = x + row * dim;
  float ss = 0.f;
  for (int d = threadIdx.x * 8; d < dim; d += kWarp * 8) {
    uint4 raw = *reinterpret_cast<const uint4*>(xr + d);
    const bf16* v = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float f = __bfloat162float(v[k]);
      ss += f * f;
    }
  }
  ss = warp_sum(ss);
  float r = rsqrtf(ss / dim + eps);
  if (threadIdx.x == 0) rstd[row] = r;
  bf16* yr = y + row * dim;
  for (int d = threadIdx.x * 8; d < dim; d += kWarp * 8) {
    uint4 raw = *reinterpret_cast<const uint4*>(xr + d);
    uint4 wraw = *reinterpret_cast<const uint4*>(w + d);
    const bf16* v = reinterpret_cast<const bf16*>(&raw);
    const bf16* wv = reinterpret_cast<const bf16*>(&wraw);
    uint4 out;
    bf16* o = reinterpret_cast<bf16*>(&out);
#pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = __float2bfloat16(__bfloat162float(v[k]) * r * __bfloat162float(wv[k]));
    *reinterpret_cast<uint4*>(yr + d) = out;
  }
}

__global__ void rmsnorm_backward_dx_kernel(bf16* dx, const bf16* dy, const bf16* x, const bf16* w, const float* rstd,
                                           int64_t rows, int dim) {
  int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (row >= rows) return;
  const bf16 *xr = x + row * dim, *dyr = dy + row * dim;
  float r = rstd[row];
  float dot = 0.f;  // sum_d w dy x
  for (int d = threadIdx.x * 8; d < dim; d += kWarp * 8) {
    uint4 xa = *reinterpret_cast<const uint4*>(xr + d), ya = *reinterpret_cast<const uint4*>(dyr + d),
          wa = *reinterpret_cast<const uint4*>(w + d);
    const bf16 *xv = reinterpret_cast<const bf16*>(&xa), *yv = reinterpret_cast<const bf16*>(&ya),
               *wv = reinterpret_cast<const bf16*>(&wa);
#pragma unroll
    for (int k = 0; k < 8; ++k) dot += __bfloat162float(wv[k]) * __bfloat162float(yv[k]) * __bfloat162float(xv[k]);
  }
  dot = warp_sum(dot);
  float c = dot * r * r * r / dim;
  bf16* dxr = dx + row * dim;
  for (int d = threadIdx.x * 8; d < dim; d += kWarp * 8) {
    uint4 xa = *reinterpret_cast<const uint4*>(xr + d), ya = *reinterpret_cast<const uint4*>(dyr + d),
          wa = *reinterpret_cast<const uint4*>(w + d), da = *reinterpret_cast<const uint4*>(dxr + d);
    const bf16 *xv = reinterpret_cast<const bf16*>(&xa), *yv = reinterpret_cast<const bf16*>(&ya),
               *wv = reinterpret_cast<const bf16*>(&wa);
    bf16* dv = reinterpret_cast<bf16*>(&da);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float g = __bfloat162float(wv[k]) * __bfloat162float(yv[k]) * r - __bfloat162float(xv[k]) * c;
      dv[k] = __float2bfloat16(__bfloat162float(dv[k]) + g);
    }
    *reinterpret_cast<uint4*>(dxr + d) = da;
  }
}

// partial[p, d] = sum over rows [p * kRowsPerPartial, ...) of dy * x * rstd; each thread
// sums 8 adjacent columns with 16-byte loads.
__global__ void rmsnorm_dweight_partial_kernel(float* partial, const bf16* dy, const bf16* x, const float* rstd,
                                               int64_t rows, int dim) {
  int d = (blockIdx.x * kPartialThreads + threadIdx.x) * 8;
  if (d >= dim) return;
  int64_t begin = static_cast<int64_t>(blockIdx.y) * kRowsPerPartial;
  int64_t end = min(rows, begin + kRowsPerPartial);
  float s[8] = {};
  for (int64_t r = begin; r < end; ++r) {
    uint4 ya = *reinterpret_cast<const uint4*>(dy + r * dim + d), xa = *reinterpret_cast<const uint4*>(x + r * dim + d);
    const bf16 *yv = reinterpret_cast<const bf16*>(&ya), *xv = reinterpret_cast<const bf16*>(&xa);
    float rs = rstd[r];
#pragma unroll
    for (int k = 0; k < 8; ++k) s[k] += __bfloat162float(yv[k]) * __bfloat162float(xv[k]) * rs;
  }
  float4* out = reinterpret_cast<float4*>(partial + static_cast<int64_t>(blockIdx.y) * dim + d);
  out[0] = make_float4(s[0], s[1], s[2], s[3]);
  out[1] = make_float4(s[4], s[5], s[6], s[7]);
}

__global__ void sum_partials_kernel(float* out, const float* partial, int parts, int dim) {
  int d = blockIdx.x * blockDim.x + threadIdx.x;
  if (d >= dim) return;
  float s = out[d];
  for (int p = 0; p < parts; ++p) s += partial[static_cast<int64_t>(p) * dim + d];
  out[d] = s;
}

}  // namespace

void rmsnorm_forward(bf16* y, float* rstd, const bf16* x, const bf16* weight, int64_t rows, int64_t dim, float eps) {
  FORGE_CHECK(dim % 8 == 0, "rmsnorm: dim {} must be a multiple of 8 on CUDA", dim);
  dim3 block(kWarp, kRowsPerBlock);
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  if (grid) rmsnorm_forward_kernel<<<grid, block>>>(y, rstd, x, weight, rows, static_cast<int>(dim), eps);
  FORGE_CUDA_LAUNCH_CHECK();
}

void rmsnorm_backward(bf16* dx, float* dweight, const bf16* dy, const bf16* x, const bf16* weight,
                      const float* rstd, int64_t rows, int64_t dim) {
  FORGE_CHECK(dim % 8 == 0, "rmsnorm: dim {} must be a multiple of 8 on CUDA", dim);
  if (rows == 0) return;
  dim3 block(kWarp, kRowsPerBlock);
  unsigned grid = static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
  rmsnorm_backward_dx_kernel<<<grid, block>>>(dx, dy, x, weight, rstd, rows, static_cast<int>(dim));
  FORGE_CUDA_LAUNCH_CHECK();
  int parts = static_cast<int>((rows + kRowsPerPartial - 1) / kRowsPerPartial);
  float* partial = static_cast<float*>(scratch_buffer(ScratchSlot::RmsnormPartials, sizeof(float) * parts * dim));
  dim3 pgrid(static_cast<unsigned>((dim / 8 + kPartialThreads - 1) / kPartialThreads), static_cast<unsigned>(parts));
  rmsnorm_dweight_partial_kernel<<<pgrid, kPartialThreads>>>(partial, dy, x, rstd, rows, static_cast<int>(dim));
  FORGE_CUDA_LAUNCH_CHECK();
  sum_partials_kernel<<<static_cast<unsigned>((dim + 255) / 256), 256>>>(dweight, partial, parts,
                                                                         static_cast<int>(dim));
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
