// Column sums of partial rows, the fixed-order second pass of the deterministic weight- and
// bias-gradient reductions (kernels/cuda/qk_norm_rope.cu, kernels/cuda/bias.cu; rmsnorm.cu
// keeps its own). A block covers 32 columns with 8 lanes each: lane l adds partial rows
// l, l + 8, l + 16, ... of its column (coalesced: a warp reads 32 neighbouring floats of a
// row), then lane 0 adds the 8 lanes' sums in lane order. The partition depends on `parts`
// only, so the result is the same on every run and every device: no float atomics.
#include "kernels/cuda/partial_sums.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kColumns = 32;  // columns per block
constexpr int kLanes = 8;     // threads sharing one column

__global__ void __launch_bounds__(kColumns * kLanes)
    sum_partial_rows_kernel(float* out, const float* partial, int64_t parts, int64_t columns, int64_t stride,
                            bool accumulate) {
  __shared__ float lane_sums[kLanes][kColumns];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  float s = 0.f;
  if (c < columns)
    for (int64_t p = threadIdx.y; p < parts; p += kLanes) s += partial[p * stride + c];
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= columns) return;
  float total = accumulate ? out[c] : 0.f;
  for (int l = 0; l < kLanes; ++l) total += lane_sums[l][threadIdx.x];
  out[c] = total;
}

}  // namespace

void sum_partial_rows(float* out, const float* partial, int64_t parts, int64_t columns, int64_t stride,
                      bool accumulate) {
  if (columns == 0) return;
  const unsigned grid = static_cast<unsigned>((columns + kColumns - 1) / kColumns);
  sum_partial_rows_kernel<<<grid, dim3(kColumns, kLanes)>>>(out, partial, parts, columns, stride, accumulate);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
