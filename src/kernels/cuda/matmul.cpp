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
// beta = 1. The algorithm is cuBLASLt's first heuristic choice, looked up once per
// (shape, transposes, output dtype) and cached; one 32 MiB workspace per GPU is shared.
#include "kernels/cuda/matmul.h"

#include <cublasLt.h>

#include <map>
#include <mutex>
#include <tuple>

#include "core/device.h"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

using PlanKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, DType>;

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

Plan make_plan(Context& ctx, const PlanKey& key) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype] = key;
  Plan p;
  cudaDataType_t c_type = out_dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  // Column-major problem (N, M, K): first operand is b, second is a.
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

  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = kWorkspaceBytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.handle, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  FORGE_CHECK(found > 0, "cuBLASLt has no algorithm for [{}x{}x{}] ta={} tb={} out={}", m, n, k, transpose_a,
              transpose_b, dtype_name(out_dtype));
  p.algo = result.algo;
  return p;
}

}  // namespace

void matmul(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b, int64_t m,
            int64_t n, int64_t k, float alpha, float beta) {
  if (m == 0 || n == 0) return;
  Context& ctx = context();
  PlanKey key{m, n, k, transpose_a, transpose_b, out_dtype};
  const Plan* plan;
  {
    std::lock_guard lock(ctx.mu);
    auto it = ctx.plans.find(key);
    if (it == ctx.plans.end()) it = ctx.plans.emplace(key, make_plan(ctx, key)).first;
    plan = &it->second;
  }
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan->op, &alpha, b, plan->a, a, plan->b, &beta, out, plan->c, out,
                              plan->c, &plan->algo, ctx.workspace, kWorkspaceBytes, nullptr));
}

}  // namespace forge::cuda
