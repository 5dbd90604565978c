// General matrix multiply, the op behind every linear layer.
//   out[M, N] = alpha * op(a) @ op(b) + beta * out,   op(x) = x or x^T
// a is [M, K] (or [K, M] with transpose_a), b is [K, N] (or [N, K] with transpose_b).
// Linear layers keep weights as [out_features, in_features] (the Hugging Face layout):
//   forward  y  = x W^T      matmul(y, x, false, W, true)
//   backward dx = dy W       matmul(dx, dy, false, W, false)
//            dW += dy^T x    matmul(dW, dy, true, x, false, 1, 1)
#pragma once

#include <string>

#include "core/tensor.h"
#include "kernels/gemm_tuning_cache.h"

namespace forge {

void matmul(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
            float alpha = 1.0f, float beta = 0.0f);

// out = op(a) @ op(b) + addend, addend shaped and typed like out (a residual stream: the
// block's input plus its projection). On the GPU the addend is the GEMM's C operand, so
// nothing is copied; addend may be out itself.
void matmul_add(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                const Tensor& addend);

// As matmul, for a GEMM one of whose dimensions changes from call to call while the rest
// of its problem stays (a Mixture-of-Experts expert's rows: M of its forward and input
// gradient, K of its weight gradient): on the GPU the sizes of a bucket share one cuBLASLt
// plan (NOTE [GEMMs of varying size] in kernels/cuda/matmul.cpp); the CPU runs matmul.
enum class GemmVarying : uint8_t { M, K };
void matmul_varying(GemmVarying varying, const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b,
                    bool transpose_b, float alpha = 1.0f, float beta = 0.0f);

// `batch` GEMMs of one shape at once: out [batch, M, N], a [batch, M, K] (or [batch, K, M]),
// b [batch, K, N] (or [batch, N, K]), matrix i of out from matrix i of a and b. On the GPU
// one cuBLASLt call (NOTE [Batched GEMMs] in kernels/cuda/matmul.cpp); the CPU runs each.
void matmul_batched(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                    float alpha = 1.0f, float beta = 0.0f);

// GPU GEMMs, bf16 and FP8: choose each shape's algorithm by timing cuBLASLt's candidates
// on first use instead of taking its first heuristic choice (training.gemm_tuning),
// keeping the measured choices in `cache_directory` for later runs ("": not kept; see
// gemm_tuning_cache_dir and NOTE [GEMM tuning cache]). No effect on the CPU reference.
// A GEMM with work fused into its output pass (NOTE [GEMM epilogues] in
// kernels/cuda/matmul.cpp), for the linear ops on CUDA. `vector` and `aux` by kind:
//   Bias               out = op(a) op(b) [+ addend] + vector      (vector [n], out's dtype)
//   GeluAuxBias        aux = op(a) op(b) + vector, out = gelu_tanh(aux)   (aux like out)
//   BiasGradient       out = op(a) op(b) (beta as given); vector [m] fp32 = the sums over k
//                      of op(a), written over (a = dy transposed: the bias gradient)
//   DGelu              out = (op(a) op(b)) * gelu_tanh'(aux); no vector (an empty tensor)
// Returns false, having done nothing, when it cannot fuse: tensors not on CUDA, or no
// cuBLASLt algorithm for the fused problem; the caller then runs the GEMM and the separate
// op(s) itself.
enum class MatmulEpilogue : uint8_t { Bias, GeluAuxBias, BiasGradient, DGelu };
bool matmul_epilogue(MatmulEpilogue kind, const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b,
                     bool transpose_b, float beta, const Tensor* addend, const Tensor& vector,
                     const Tensor* aux = nullptr);

void set_gemm_tuning(bool enabled, const std::string& cache_directory = "");

// How the current GPU's GEMM algorithms were chosen so far; all zero on the CPU.
GemmTuningStats gemm_tuning_stats();

// NOTE [Column blocks]
// Columns [first, first + cols) of a dense 2-D tensor, as an operand of the GEMMs of a
// linear layer over concatenated inputs (NOTE [Linear over concatenated inputs] in
// ops/linear.h): its weight's column blocks, and its weight gradient's. It is not a tensor
// (every tensor is dense, NOTE [Contiguous tensors] in core/tensor.h) and nothing but
// matmul_blocks and matmul_blocks_epilogue reads one. On the GPU the GEMM reads or writes
// the block in place through a cuBLASLt layout with the whole matrix's width as its
// leading dimension (NOTE [Column-block GEMMs] in kernels/cuda/matmul.cpp), which wants
// the block's first column and the width at multiples of 16 bytes (checked); the CPU
// reference copies the block into a dense tensor and back.
struct ColumnBlock {
  Tensor matrix;      // dense [rows, width]
  int64_t first = 0;  // the block's first column
  int64_t cols = 0;   // its width
};

// Columns [first, first + cols) of `matrix` (checked to lie within it); all of them.
ColumnBlock column_block(const Tensor& matrix, int64_t first, int64_t cols);
ColumnBlock all_columns(const Tensor& matrix);

// out = op(a) op(b) + beta c with alpha 1, out and b column blocks ([m, n], and [k, n] or
// with transpose_b [n, k]); c is out, or `addend` (dense, shaped like out, which must then
// be a whole tensor). As matmul otherwise.
void matmul_blocks(const ColumnBlock& out, const Tensor& a, bool transpose_a, const ColumnBlock& b, bool transpose_b,
                   float beta, const Tensor* addend = nullptr);

// As matmul_epilogue (above), with out and b column blocks; `aux` is dense. false on the CPU.
bool matmul_blocks_epilogue(MatmulEpilogue kind, const ColumnBlock& out, const Tensor& a, bool transpose_a,
                            const ColumnBlock& b, bool transpose_b, float beta, const Tensor* addend,
                            const Tensor& vector, const Tensor* aux = nullptr);

}  // namespace forge
