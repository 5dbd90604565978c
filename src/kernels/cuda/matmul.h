#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "kernels/gemm_tuning_cache.h"

namespace forge::cuda {

// The leading dimensions of a GEMM whose b or out is a column block of a wider row-major
// matrix (NOTE [Column-block GEMMs] in matmul.cpp): the elements from one of its rows to the
// next, 0 for a dense operand (whose rows are its own width apart). The pointer passed for
// such an operand is its block's first element. a and an addend are always dense.
struct GemmLeadingDims {
  int64_t b = 0;
  int64_t out = 0;
};

// Row-major out[M, N] = alpha * op(a) @ op(b) + beta * c on the GPU through cuBLASLt,
// where c is out itself, or `addend` (same shape and dtype as out) when one is given.
// a and b are bf16; out is bf16 or fp32 (out_dtype); accumulation is fp32.
// a is [M, K] ([K, M] with transpose_a); b is [K, N] ([N, K] with transpose_b).
// `ld`: b or out a column block (an addend only with a dense out).
void matmul(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b, int64_t m,
            int64_t n, int64_t k, float alpha, float beta, const void* addend = nullptr, GemmLeadingDims ld = {});

// What a GEMM does to its result on the way out (NOTE [GEMM epilogues] in matmul.cpp).
enum class GemmEpilogue : uint8_t { None, Bias, GeluAuxBias, BiasGradient, DGelu };

struct GemmEpilogueOperands {
  GemmEpilogue kind = GemmEpilogue::None;
  const void* bias = nullptr;     // Bias, GeluAuxBias: [n] bf16, added to every row of out
  void* aux = nullptr;            // GeluAuxBias: [m, n] bf16 pre-activation (written); DGelu: read
  void* bias_gradient = nullptr;  // BiasGradient: [m] fp32 sums over k of op(a), written over
};

// As matmul, with the epilogue fused into the GEMM. Returns false, having run nothing,
// when cuBLASLt has no algorithm for the fused problem (or m or n is 0): the caller then
// runs the GEMM and its separate passes itself.
bool matmul_epilogue(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b,
                     int64_t m, int64_t n, int64_t k, float alpha, float beta, const void* addend,
                     const GemmEpilogueOperands& epilogue, GemmLeadingDims ld = {});

// A dimension of a GEMM that changes from call to call while the rest of its problem stays
// (a Mixture-of-Experts expert's rows: M of its forward and input gradient, K of its weight
// gradient). NOTE [GEMMs of varying size] in matmul.cpp.
enum class GemmVarying : uint8_t { None, M, K };

// As matmul, with `varying` naming the dimension that varies between calls.
void matmul_varying(GemmVarying varying, void* out, DType out_dtype, const void* a, bool transpose_a, const void* b,
                    bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, float beta);

// `batch` GEMMs of one shape (NOTE [Batched GEMMs] in matmul.cpp): out, a and b each hold
// `batch` matrices one after another, matrix i of each at i x its own size; otherwise as
// matmul, without an addend.
void matmul_batched(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b,
                    int64_t m, int64_t n, int64_t k, int64_t batch, float alpha, float beta);

// NOTE [GEMM algorithm choice] in matmul.cpp: heuristic (default) or measured per shape,
// measured choices kept in `cache_directory` ("": not kept; NOTE [GEMM tuning cache]).
// One switch for the bf16 and the FP8 GEMMs (fp8_matmul.h); defined in gemm_tuner.cpp.
void set_gemm_tuning(bool enabled, const std::string& cache_directory);

// How the current GPU's plans, bf16 and FP8, were chosen so far.
GemmTuningStats gemm_tuning_stats();

// Drops the current GPU's plans (bf16 and FP8), its opened tuning cache and its counters,
// as if the process had just started (for tests). Not while other threads run GEMMs on
// this GPU.
void forget_gemm_plans();

}  // namespace forge::cuda
