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
// Each (shape, transposes, output dtype) gets its algorithm once, on first use, and keeps
// it. By default that is cuBLASLt's first heuristic choice. With measured selection
// (training.gemm_tuning, what Megatron's GEMM_TUNING does) the first call times up to
// kTuningCandidates of the heuristic's candidates on the call's own operands — into a
// scratch copy of the output, so the call's result is untouched — and keeps the fastest.
// If the scratch copy does not fit in free memory, that shape keeps the heuristic choice.
// Different algorithms round differently, so tuned runs are reproducible only on the same
// GPU model and cuBLAS version.
#include "kernels/cuda/matmul.h"

#include <cublasLt.h>

#include <atomic>
#include <map>
#include <mutex>
#include <tuple>

#include "core/device.h"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr int kTuningCandidates = 16;
constexpr int kTuningRepeats = 5;

std::atomic<bool> g_tuning{false};  // set_gemm_tuning, for every GPU's context

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

// The operands of one call, for timing candidate algorithms on them.
struct Operands {
  void* out;
  const void* a;
  const void* b;
  float alpha, beta;
  const void* c;  // the C operand: out itself, or a separate addend
};

// Mean milliseconds of one candidate over kTuningRepeats runs after a warm-up run, or a
// negative value when the candidate fails to run.
float time_algorithm(Context& ctx, const Plan& p, const cublasLtMatmulAlgo_t& algo, const Operands& x, void* scratch) {
  const void* c = x.c == x.out ? scratch : x.c;
  auto run = [&] {
    return cublasLtMatmul(ctx.handle, p.op, &x.alpha, x.b, p.a, x.a, p.b, &x.beta, c, p.c, scratch, p.c, &algo,
                          ctx.workspace, kWorkspaceBytes, nullptr);
  };
  if (run() != CUBLAS_STATUS_SUCCESS) return -1.0f;
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  CUDA_CHECK(cudaEventRecord(start));
  for (int i = 0; i < kTuningRepeats; ++i) CUBLAS_CHECK(run());
  CUDA_CHECK(cudaEventRecord(stop));
  CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / kTuningRepeats;
}

// The fastest of the heuristic's candidates, timed on a scratch copy of the output.
void choose_by_timing(Context& ctx, Plan& p, const cublasLtMatmulHeuristicResult_t* candidates, int count,
                      const Operands& x, size_t out_bytes) {
  void* scratch = nullptr;
  if (cudaMalloc(&scratch, out_bytes) != cudaSuccess) {
    cudaGetLastError();  // clear the allocation failure; this shape keeps the heuristic choice
    return;
  }
  if (x.beta != 0.0f && x.c == x.out) CUDA_CHECK(cudaMemcpy(scratch, x.out, out_bytes, cudaMemcpyDeviceToDevice));
  float best = -1.0f;
  for (int i = 0; i < count; ++i) {
    float ms = time_algorithm(ctx, p, candidates[i].algo, x, scratch);
    if (ms >= 0.0f && (best < 0.0f || ms < best)) {
      best = ms;
      p.algo = candidates[i].algo;
    }
  }
  CUDA_CHECK(cudaFree(scratch));
}

Plan make_plan(Context& ctx, const PlanKey& key, const Operands& operands) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype] = key;
  const bool tuning = g_tuning;
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
  cublasLtMatmulHeuristicResult_t results[kTuningCandidates]{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.handle, p.op, p.a, p.b, p.c, p.c, pref,
                                              tuning ? kTuningCandidates : 1, results, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  FORGE_CHECK(found > 0, "cuBLASLt has no algorithm for [{}x{}x{}] ta={} tb={} out={}", m, n, k, transpose_a,
              transpose_b, dtype_name(out_dtype));
  p.algo = results[0].algo;
  if (tuning && found > 1)
    choose_by_timing(ctx, p, results, found, operands,
                     static_cast<size_t>(m) * static_cast<size_t>(n) * dtype_size(out_dtype));
  return p;
}

}  // namespace

void matmul(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b, int64_t m,
            int64_t n, int64_t k, float alpha, float beta, const void* addend) {
  if (m == 0 || n == 0) return;
  const void* c = addend ? addend : out;
  Context& ctx = context();
  PlanKey key{m, n, k, transpose_a, transpose_b, out_dtype};
  const Plan* plan;
  {
    std::lock_guard lock(ctx.mu);
    auto it = ctx.plans.find(key);
    if (it == ctx.plans.end()) it = ctx.plans.emplace(key, make_plan(ctx, key, {out, a, b, alpha, beta, c})).first;
    plan = &it->second;
  }
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan->op, &alpha, b, plan->a, a, plan->b, &beta, c, plan->c, out, plan->c,
                              &plan->algo, ctx.workspace, kWorkspaceBytes, nullptr));
}

void set_gemm_tuning(bool enabled) { g_tuning = enabled; }  // for shapes first seen from now on

}  // namespace forge::cuda
