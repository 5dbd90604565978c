// A bias on every row of a bf16 activation, and its gradient, on the GPU (ops/bias.h).
//
// add_bias is elementwise and memory-bound: with F a multiple of 8 (and 16-byte aligned
// tensors, as every linear layer's are) each thread adds 8 columns with one 16-byte load of
// y, one of the bias (from L2: it is F elements) and one 16-byte store; otherwise one
// element per thread. The sum is in fp32, rounded to bf16 once.
//
// bias_gradient is a column sum of dy [N, F] in fp32, split so that it is deterministic
// (kernels/cuda/partial_sums.h): a block covers 32 columns of a fixed range of 256 rows,
// 8 lanes per column, lane l adding rows l, l + 8, ... of the range (a warp reads 32
// neighbouring bf16 of a row), and the lanes' sums are added in lane order into one partial
// row per range; sum_partial_rows then adds the ranges' rows in order into grad (written
// over or added to). The split depends on N and F only. Bytes: dy read once, plus N F / 64
// floats of partial rows (a 64th of dy's bytes) written and read back.
#include "kernels/cuda/bias.h"

#include <cstdint>

#include "kernels/cuda/bf16x8.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/partial_sums.h"
#include "kernels/cuda/scratch.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kColumns = 32;        // columns per block of the column sum
constexpr int kLanes = 8;           // threads sharing one column there
constexpr int64_t kRowsPerPart = 256;  // rows per partial row

__global__ void add_bias8_kernel(uint4* y, const uint4* bias, int64_t vectors, int64_t row_vectors) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= vectors) return;
  float v[8], b[8];
  unpack8(y[i], v);
  unpack8(bias[i % row_vectors], b);
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] += b[k];
  y[i] = pack8(v);
}

__global__ void add_bias_kernel(bf16* y, const bf16* bias, int64_t elements, int64_t features) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= elements) return;
  y[i] = __float2bfloat16(__bfloat162float(y[i]) + __bfloat162float(bias[i % features]));
}

// Block (x, y): columns [x * 32, x * 32 + 32), rows [y * kRowsPerPart, ...) into partial row y.
__global__ void __launch_bounds__(kColumns * kLanes)
    column_partials_kernel(float* partial, const bf16* dy, int64_t rows, int64_t features) {
  __shared__ float lane_sums[kLanes][kColumns];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumns + threadIdx.x;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * kRowsPerPart;
  const int64_t end = min(rows, begin + kRowsPerPart);
  float s = 0.f;
  if (c < features)
    for (int64_t n = begin + threadIdx.y; n < end; n += kLanes) s += __bfloat162float(dy[n * features + c]);
  lane_sums[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || c >= features) return;
  float total = 0.f;
  for (int l = 0; l < kLanes; ++l) total += lane_sums[l][threadIdx.x];
  partial[static_cast<int64_t>(blockIdx.y) * features + c] = total;
}

}  // namespace

void add_bias(bf16* y, const bf16* bias, int64_t rows, int64_t features) {
  const int64_t elements = rows * features;
  if (elements == 0) return;
  const bool vectorized = features % 8 == 0 && reinterpret_cast<uintptr_t>(y) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(bias) % 16 == 0;
  if (vectorized) {
    const int64_t vectors = elements / 8;
    add_bias8_kernel<<<static_cast<unsigned>((vectors + kThreads - 1) / kThreads), kThreads>>>(
        reinterpret_cast<uint4*>(y), reinterpret_cast<const uint4*>(bias), vectors, features / 8);
  } else {
    add_bias_kernel<<<static_cast<unsigned>((elements + kThreads - 1) / kThreads), kThreads>>>(y, bias, elements,
                                                                                               features);
  }
  FORGE_CUDA_LAUNCH_CHECK();
}

void bias_gradient(float* grad, const bf16* dy, int64_t rows, int64_t features, bool overwrite) {
  if (features == 0) return;
  const int64_t parts = (rows + kRowsPerPart - 1) / kRowsPerPart;
  FORGE_CHECK(parts < 65536, "bias_gradient: {} rows exceed {} on CUDA", rows, 65535 * kRowsPerPart);
  float* partial = nullptr;  // no rows: no partial rows, and the sums are zero
  if (parts > 0) {
    partial = static_cast<float*>(
        scratch_buffer(ScratchSlot::BiasGradientPartials, sizeof(float) * static_cast<size_t>(parts * features)));
    const dim3 grid(static_cast<unsigned>((features + kColumns - 1) / kColumns), static_cast<unsigned>(parts));
    column_partials_kernel<<<grid, dim3(kColumns, kLanes)>>>(partial, dy, rows, features);
    FORGE_CUDA_LAUNCH_CHECK();
  }
  sum_partial_rows(grad, partial, parts, features, features, !overwrite);
}

}  // namespace forge::cuda
