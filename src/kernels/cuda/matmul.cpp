// GEMM through cuBLASLt, the op behind every linear layer on the GPU.
//
// NOTE [Row-major GEMM on a column-major library]
// cuBLASLt is column-major. A row-major matrix X[r, c] is, byte for byte, the column-major
// matrix X^T (c x r). So the row-major product C = op(a) op(b) is computed as the
// column-major product C^T = op(b)^T op(a)^T: the first operand is b, the second is a,
// the problem is (m', n', k') = (N, M, K), and each operand's transpose flag carries over
// unchanged. No transpose is ever materialized.
//
// Inputs are bf16 with fp32 accumulation (CUBLAS_COMPUTE_32F); the output is bf16 for
// activations or fp32 for weight gradients, which accumulate across micro-batches with
// beta = 1 (the first micro-batch of a step writes them with beta = 0). The C operand is
// the output itself, or a separate addend of the same layout (a block's residual input),
// which saves copying it into the output first. One 32 MiB workspace per GPU is shared.
//
// NOTE [GEMM algorithm choice]
// Each (shape, transposes, output dtype, beta == 0) gets its algorithm once, on first use,
// and keeps it. By default that is cuBLASLt's first heuristic choice. With measured
// selection (training.gemm_tuning, what Megatron's GEMM_TUNING does) the first call times
// candidates on the call's own operands, into a scratch copy of the output so the call's
// result is untouched, and keeps the fastest. The candidates are the heuristic's first 16
// and variants of its first 4 with every thread block cluster shape of 1x1, 2x1 and 1x2
// and every "custom option" the algorithm accepts (cublasLtMatmulAlgoCheck says which
// run): scripts/gemm-search.cu found these two knobs worth up to 7.5% on the 8B shapes
// (docs/PERF.md). Each candidate is screened with one run after a warm-up; the 4 fastest
// and the heuristic's first are then timed round robin, 5 rounds of 2 runs, and the
// lowest median wins, so one slow or fast moment of the GPU's clock does not decide.
// beta is part of the key because a beta-1 call reads C and may prefer another tile.
// If the scratch copy does not fit in free memory, that shape keeps the heuristic choice.
// Different algorithms round differently, so tuned runs are reproducible only on the same
// GPU model and cuBLAS version. The FP8 GEMMs (fp8_matmul.cpp) are chosen the same way,
// keyed also on their formats, scale modes and fast accumulation, with their scale pointers
// set on the descriptor before the heuristic query and the timing (the timing runs use the
// call's own codes and factors). The machinery is kernels/cuda/gemm_tuner.h, which sees
// only cuBLASLt's descriptors and pointers; the settings, the cache and the counters are
// shared by both kinds of GEMM.
//
// The timing costs seconds per run (10.8 s of the 8B proxy's first step on an H100), so
// measured choices are kept on disk and taken by later runs on the same GPU model and
// cuBLASLt version (NOTE [GEMM tuning cache] in kernels/gemm_tuning_cache.h): a tuned plan
// first looks there, runs the stored algorithm past cublasLtMatmulAlgoCheck for its
// problem, and only times candidates when there is none or cuBLASLt rejects it; each
// shape timed is added to the file at once. A side effect worth having: runs that share
// a cache take the same algorithms, so they round alike, where each run's own timing
// could pick differently.
#include "kernels/cuda/matmul.h"

#include <cublasLt.h>

#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "core/device.h"
#include "kernels/cuda/cublaslt_context.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/fp8_matmul.h"
#include "kernels/cuda/gemm_tuner.h"

namespace forge::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr cublasComputeType_t kComputeType = CUBLAS_COMPUTE_32F;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

using PlanKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, DType, bool>;  // ..., beta == 0

struct Context {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, Plan> plans;
  std::mutex mu;

  Context() {
    CUBLAS_CHECK(cublasLtCreate(&handle));
    workspace = device_malloc(kWorkspaceBytes);
  }
};

// One context per GPU: the workspace lives on the GPU the context was made on, so a
// process that runs GEMMs on several GPUs (forge preflight) must not share it.
Context& context() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<int, Context*> contexts;  // live for the process: destroying them at exit races the driver
  std::lock_guard lock(mu);
  Context*& ctx = contexts[device];
  if (!ctx) ctx = new Context();
  return *ctx;
}

// The plan's descriptors for the column-major problem (N, M, K), without an algorithm:
// the first operand is b, the second a.
Plan describe_problem(const PlanKey& key) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero] = key;
  (void)beta_zero;  // it decides the algorithm, not the descriptors
  Plan p;
  cudaDataType_t c_type = out_dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, kComputeType, CUDA_R_32F));
  cublasOperation_t op_first = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_second = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  // Stored shapes (rows x cols, column-major, ld = rows).
  if (transpose_b)
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
  else
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, n, k, n));
  if (transpose_a)
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, m, k, m));
  else
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_type, n, m, n));
  return p;
}

void destroy_plan(Plan& p) {
  cublasLtMatrixLayoutDestroy(p.c);
  cublasLtMatrixLayoutDestroy(p.b);
  cublasLtMatrixLayoutDestroy(p.a);
  cublasLtMatmulDescDestroy(p.op);
}

// The key of a plan's choice in the tuning cache: everything that decides it.
GemmProblem tuning_problem(const PlanKey& key) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero] = key;
  return GemmProblem{m, n, k, transpose_a, transpose_b, DType::BF16, out_dtype, beta_zero, kComputeType,
                     kWorkspaceBytes, std::nullopt};
}

// The plan for a problem seen for the first time, its algorithm chosen on the call's own
// operands (out, a, b in forge's roles; cuBLASLt's A is b, its B is a).
Plan make_plan(Context& ctx, const PlanKey& key, void* out, const void* a, const void* b, float alpha, float beta,
               const void* c) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero] = key;
  (void)beta_zero;  // the operands carry beta itself
  Plan p = describe_problem(key);
  const CublasLtOperands operands{b, a, c, out, alpha, beta,
                                  static_cast<size_t>(m) * static_cast<size_t>(n) * dtype_size(out_dtype)};
  const std::optional<cublasLtMatmulAlgo_t> algo =
      choose_gemm_algorithm(CublasLtContext{ctx.handle, ctx.workspace, kWorkspaceBytes}, {p.op, p.a, p.b, p.c, p.c},
                            operands, tuning_problem(key));
  if (!algo) destroy_plan(p);
  FORGE_CHECK(algo.has_value(), "cuBLASLt has no algorithm for [{}x{}x{}] ta={} tb={} out={}", m, n, k, transpose_a,
              transpose_b, dtype_name(out_dtype));
  p.algo = *algo;
  return p;
}

}  // namespace

void matmul(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b, int64_t m,
            int64_t n, int64_t k, float alpha, float beta, const void* addend) {
  if (m == 0 || n == 0) return;
  const void* c = addend ? addend : out;
  Context& ctx = context();
  PlanKey key{m, n, k, transpose_a, transpose_b, out_dtype, beta == 0.0f};
  const Plan* plan;
  {
    std::lock_guard lock(ctx.mu);
    auto it = ctx.plans.find(key);
    if (it == ctx.plans.end()) it = ctx.plans.emplace(key, make_plan(ctx, key, out, a, b, alpha, beta, c)).first;
    plan = &it->second;
  }
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan->op, &alpha, b, plan->a, a, plan->b, &beta, c, plan->c, out, plan->c,
                              &plan->algo, ctx.workspace, kWorkspaceBytes, nullptr));
}

CublasLtContext cublaslt_context() {
  Context& ctx = context();
  return CublasLtContext{ctx.handle, ctx.workspace, kWorkspaceBytes};
}

void forget_gemm_plans() {
  {
    Context& ctx = context();
    std::lock_guard lock(ctx.mu);
    CUDA_CHECK(cudaDeviceSynchronize());  // no GEMM in flight still reads a descriptor
    for (auto& [key, plan] : ctx.plans) destroy_plan(plan);
    ctx.plans.clear();
  }
  forget_fp8_gemm_plans();
  forget_gemm_tuning_state();
}

}  // namespace forge::cuda
