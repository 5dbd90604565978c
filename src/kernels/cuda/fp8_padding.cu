// FP8 codes padded with zero columns (NOTE [FP8 padded token contraction] in
// ops/fp8_linear.h).
//
// Hopper's FP8 GEMMs contract over a multiple of 16 (NOTE [FP8 GEMM layout] in
// kernels/cuda/fp8_matmul.h). A weight gradient contracts over its tokens, which for a
// routed expert are whatever rows the routing gave it. Its two operands arrive as the
// transposed codes dy^T [out, t] and x^T [in, t]; this kernel copies such a matrix into a
// [rows, t16] buffer with the columns past t zero. The code 0 is +0 in E4M3 and in E5M2, so
// the padded columns are zero tokens, which add nothing to any dot product: the GEMM over
// t16 computes the GEMM over t exactly. One thread per output byte, memory-bound (a byte
// read and a byte written per element); the tensors it pads are an expert's share of a
// micro-batch, small beside the GEMM that follows.
#include "kernels/cuda/fp8_padding.h"

#include <cuda_runtime.h>

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void pad_columns_kernel(const uint8_t* codes, int64_t rows, int64_t cols, int64_t padded_cols,
                                   uint8_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * padded_cols) return;
  const int64_t row = i / padded_cols, col = i % padded_cols;
  out[i] = col < cols ? codes[row * cols + col] : uint8_t{0};
}

}  // namespace

void fp8_pad_columns(const uint8_t* codes, int64_t rows, int64_t cols, int64_t padded_cols, uint8_t* out) {
  const int64_t n = rows * padded_cols;
  if (n == 0) return;
  const auto blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  pad_columns_kernel<<<blocks, kThreads>>>(codes, rows, cols, padded_cols, out);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace forge::cuda
