// The algorithm choice of a cuBLASLt GEMM, shared by the bf16 GEMMs (matmul.cpp) and the
// FP8 ones (fp8_matmul.cpp): cuBLASLt's first heuristic choice, or, with measured selection
// on (set_gemm_tuning in matmul.h), the choice stored in the tuning cache or the fastest
// candidate timed on the call's own operands (NOTE [GEMM algorithm choice] in matmul.cpp,
// NOTE [GEMM tuning cache] in kernels/gemm_tuning_cache.h). It knows nothing of either
// caller's problem: it sees cuBLASLt's descriptors and pointers, and a GemmProblem as the
// cache's key.
#pragma once

#include <cublasLt.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "kernels/cuda/cublaslt_context.h"
#include "kernels/gemm_tuning_cache.h"

namespace forge::cuda {

// A problem as cuBLASLt describes it: D = alpha op(A) op(B) + beta C.
struct CublasLtDescriptors {
  cublasLtMatmulDesc_t op;  // with everything an algorithm depends on set, FP8 scale pointers included
  cublasLtMatrixLayout_t a, b, c, d;
};

// One call's operands in cuBLASLt's roles (alpha and beta fp32, the scale type of both
// callers). c may be d itself (in place) or a separate matrix of d's layout.
struct CublasLtOperands {
  const void* a;
  const void* b;
  const void* c;
  void* d;
  float alpha, beta;
  size_t d_bytes;  // the output's size, for the scratch copy timing writes into
};

// cuBLASLt's first `count` heuristic results for the problem within the context's
// workspace, best first; empty when it has none (or refuses the query).
std::vector<cublasLtMatmulHeuristicResult_t> heuristic_algorithms(const CublasLtContext& ctx,
                                                                  const CublasLtDescriptors& p, int count);

// The algorithm for a problem seen for the first time on the current GPU: with measured
// selection off, the heuristic's first; on, the cache's choice for `key` when cuBLASLt
// accepts it, else the fastest candidate timed on `x` (d itself is not written: the runs
// write a scratch copy of it, starting as a copy of c when beta is not zero and c is d),
// added to the cache. Nothing when the heuristic has no algorithm for it.
std::optional<cublasLtMatmulAlgo_t> choose_gemm_algorithm(const CublasLtContext& ctx, const CublasLtDescriptors& p,
                                                          const CublasLtOperands& x, const GemmProblem& key);

// Drops the current GPU's opened tuning cache and its counters (forget_gemm_plans).
void forget_gemm_tuning_state();

}  // namespace forge::cuda
