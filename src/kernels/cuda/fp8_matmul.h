// Scaled FP8 GEMM through cuBLASLt on Hopper (sm_90).
//
// NOTE [FP8 GEMM layout]
// Hopper's FP8 GEMMs take both operands K-major: in cuBLASLt's column-major terms A
// transposed and B not ("TN", cublasLtMatmul's FP8 requirements; Blackwell lifts this).
// Row-major, that is out[M, N] = a[M, K] @ b[N, K]^T with both a and b K-contiguous, which
// is the only form fp8_matmul offers. The three GEMMs of a linear layer y = x W^T then
// need: forward a = x [T, in], b = W [out, in]; input gradient a = dy [T, out],
// b = W^T [in, out]; weight gradient a = dy^T [out, T], b = x^T [in, T]. The transposes
// come from fp8_cast_transpose (kernels/cuda/fp8_cast.h), written in the same pass as the
// row-major codes.
//
// NOTE [FP8 GEMM scale modes on sm_90]
// cuBLASLt multiplies each operand by its dequantization factors (the inverse of the
// quantization scales, NOTE [FP8 scaling recipes] in kernels/cpu/fp8_scaling.h). The cuBLAS
// documentation of CUDA 13 (docs.nvidia.com/cuda/cublas, section 3.1.4 "Scaling Mode
// Support Overview" and 3.1.4.3 / 3.1.4.5; cublasLt.h of CUDA 13.1, cublasLtMatmulMatrixScale_t)
// lists for compute capability 9.0, FP8 E4M3/E5M2 data, fp32 factors:
//   SCALAR_32F      tensorwide, 8.9+: one factor per operand (torchao tensorwise, TE
//                   current and delayed scaling);
//   OUTER_VEC_32F   9.0 only: one factor per row of A and per column of B, set for both
//                   operands (torchao rowwise); here one per row of a and of b;
//   VEC128_32F      9.0 only: one factor per 128 elements along K (TE 1x128 / DeepSeek-V3
//                   activations and gradients);
//   BLK128x128_32F  9.0 only: one factor per 128x128 block (their weights);
//                   VEC128 x VEC128, VEC128 x BLK128x128 and BLK128x128 x VEC128 are
//                   supported, BLK128x128 x BLK128x128 is not.
// With the outer-vector and block modes D must be bf16, fp16 or fp32 (no FP8 output), M and
// N must be multiples of 4 for the block modes, and factor arrays start 16-byte aligned.
// The block factors have a layout of their own (section 3.1.4.5.1): VEC128 factors are
// [ceil(K/128)][rows] (rows contiguous), BLK128x128 factors [ceil(rows/128)][L4] with L4 =
// ceil(K/128) rounded up to a multiple of 4 (K blocks contiguous). These modes were added in
// cuBLAS 12.9 ("Boosting Matrix Multiplication Speed and Flexibility with NVIDIA cuBLAS 12.9",
// NVIDIA technical blog). PyTorch's scaled_gemm refuses fast accumulation with the two block
// modes (aten/src/ATen/cuda/CUDABlas.cpp), and so does fp8_matmul. Whether this GPU's
// cuBLASLt offers an algorithm for a combination is what fp8_matmul_supported asks.
#pragma once

#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "kernels/cpu/fp8.h"
#include "kernels/cuda/matmul.h"

namespace forge::cuda {

using cpu::Fp8Format;

enum class Fp8GemmScaling : uint8_t { Tensor, Row, Block1x128, Block128x128 };

const char* fp8_gemm_scaling_name(Fp8GemmScaling scaling);

// One operand: FP8 codes [rows, k] row-major on the device, and its dequantization factors
// (fp32, device) in cuBLASLt's layout for `scaling` (fp8_gemm_factor_layout).
struct Fp8GemmOperand {
  const uint8_t* codes;
  Fp8Format format;
  const float* factors;
  Fp8GemmScaling scaling;
};

// out[m, n] = alpha * deq(a) @ deq(b)^T + beta * out, fp32 accumulation, out bf16 or fp32
// (row-major, on the device). Not both operands E5M2. Throws, before any GPU work, with what
// is wrong for shapes, alignments and combinations cuBLASLt cannot run (NOTE [FP8 GEMM
// scale modes on sm_90]): k a multiple of 16, n * sizeof(out) of 16 bytes, 16-byte aligned
// buffers. fast_accumulation: Hopper's FP8 accumulation without periodic promotion to full
// fp32 (faster, less exact; torchao uses it for the forward GEMM only). The algorithm is
// chosen as the bf16 GEMMs' (set_gemm_tuning in matmul.h): with tuning on, the first call
// of a problem times candidates on its own operands and factors.
// `varying` names a dimension that changes from call to call (a routed expert's rows: M of
// its forward and input gradient, K of its weight gradient): the plan is kept per bucket of
// that dimension, as matmul_varying's (NOTE [GEMMs of varying size] in matmul.cpp; NOTE
// [FP8 GEMMs of varying size] in fp8_matmul.cpp). Tensorwise scaling only: with row or block
// factors it is ignored (their factor layouts follow the rows).
void fp8_matmul(void* out, DType out_dtype, const Fp8GemmOperand& a, const Fp8GemmOperand& b, int64_t m, int64_t n,
                int64_t k, float alpha, float beta, bool fast_accumulation, GemmVarying varying = GemmVarying::None);

// Whether cuBLASLt on the current GPU has an algorithm for this combination and shape (false
// also for what fp8_matmul refuses).
bool fp8_matmul_supported(DType out_dtype, Fp8Format a_format, Fp8GemmScaling a_scaling, Fp8Format b_format,
                          Fp8GemmScaling b_scaling, int64_t m, int64_t n, int64_t k, bool fast_accumulation);

// Drops the current GPU's FP8 GEMM plans (forget_gemm_plans in matmul.h, for tests).
void forget_fp8_gemm_plans();

// Number of fp32 factors an operand of [rows, k] holds for `scaling`, padding included.
int64_t fp8_gemm_factor_count(int64_t rows, int64_t k, Fp8GemmScaling scaling);

// The factors of the CPU reference's block grid (row-major over blocks of 1 x k, 1 x 128 or
// 128 x 128, one value for Tensor; kernels/cpu/fp8_scaling.h) in cuBLASLt's layout, padding
// zero. Host memory to host memory.
std::vector<float> fp8_gemm_factor_layout(const float* grid, int64_t rows, int64_t k, Fp8GemmScaling scaling);

}  // namespace forge::cuda
