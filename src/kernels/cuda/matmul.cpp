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
// GPU model and cuBLAS version.
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

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/log.h"
#include "kernels/cuda/cublaslt_context.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/gemm_tuning_cache.h"

namespace forge::cuda {
namespace {

constexpr size_t kWorkspaceBytes = 32u << 20;
constexpr cublasComputeType_t kComputeType = CUBLAS_COMPUTE_32F;
constexpr int kHeuristicCandidates = 16;
constexpr int kVariedCandidates = 4;   // of the heuristic's, varied in cluster shape and custom option
constexpr int kFinalists = 4;
constexpr int kFinalRounds = 5;
constexpr int kRunsPerRound = 2;

struct TuningSettings {
  bool enabled = false;
  std::string cache_directory;  // where measured choices are kept; "" keeps none
};

std::mutex g_settings_mu;
TuningSettings g_settings;  // set_gemm_tuning, for every GPU's context

TuningSettings tuning_settings() {
  std::lock_guard lock(g_settings_mu);
  return g_settings;
}

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
  std::optional<GemmTuningCache> cache;  // this GPU's measured choices on disk, opened by the first tuned plan
  GemmTuningStats stats;                 // counters only; the cache fills in its file and what it loaded
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

// Milliseconds per run of one candidate over `runs` runs, or a negative value when it
// fails to run.
float time_algorithm(Context& ctx, const Plan& p, const cublasLtMatmulAlgo_t& algo, const Operands& x, void* scratch,
                     int runs) {
  const void* c = x.c == x.out ? scratch : x.c;
  auto run = [&] {
    return cublasLtMatmul(ctx.handle, p.op, &x.alpha, x.b, p.a, x.a, p.b, &x.beta, c, p.c, scratch, p.c, &algo,
                          ctx.workspace, kWorkspaceBytes, nullptr);
  };
  cudaEvent_t start, stop;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  CUDA_CHECK(cudaEventRecord(start));
  bool ok = true;
  for (int i = 0; i < runs && ok; ++i) ok = run() == CUBLAS_STATUS_SUCCESS;
  CUDA_CHECK(cudaEventRecord(stop));
  CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0.0f;
  CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ok ? ms / runs : -1.0f;
}

// Whether cuBLASLt runs `algo` for the plan's problem within the workspace.
bool library_accepts(Context& ctx, const Plan& p, const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t check{};
  return cublasLtMatmulAlgoCheck(ctx.handle, p.op, p.a, p.b, p.c, p.c, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= kWorkspaceBytes;
}

// The heuristic's candidates, then variants of its first kVariedCandidates: every cluster
// shape of 1x1, 2x1, 1x2 with every custom option, where cuBLASLt accepts the combination.
std::vector<cublasLtMatmulAlgo_t> tuning_candidates(Context& ctx, const Plan& p,
                                                    const cublasLtMatmulHeuristicResult_t* heuristic, int count) {
  std::vector<cublasLtMatmulAlgo_t> candidates;
  for (int i = 0; i < count; ++i) candidates.push_back(heuristic[i].algo);
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x2x1};
  for (int i = 0; i < std::min(count, kVariedCandidates); ++i) {
    int32_t custom_max = 0;
    size_t written = 0;
    if (cublasLtMatmulAlgoCapGetAttribute(&heuristic[i].algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max,
                                          sizeof(custom_max), &written) != CUBLAS_STATUS_SUCCESS)
      custom_max = 0;
    for (uint16_t cluster : clusters)
      for (int32_t custom = 0; custom <= custom_max; ++custom) {
        cublasLtMatmulAlgo_t algo = heuristic[i].algo;
        if (cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster,
                                                 sizeof(cluster)) != CUBLAS_STATUS_SUCCESS ||
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom,
                                                 sizeof(custom)) != CUBLAS_STATUS_SUCCESS ||
            !library_accepts(ctx, p, algo))
          continue;
        candidates.push_back(algo);
      }
  }
  return candidates;
}

// The fastest candidate, timed on a scratch copy of the output: a screening run of each,
// then the kFinalists fastest and the heuristic's first (candidates[0]) round robin.
// False when nothing could be timed and p keeps the heuristic's choice.
bool choose_by_timing(Context& ctx, Plan& p, const std::vector<cublasLtMatmulAlgo_t>& candidates, const Operands& x,
                      size_t out_bytes) {
  void* scratch = nullptr;
  if (cudaMalloc(&scratch, out_bytes) != cudaSuccess) {
    cudaGetLastError();  // clear the allocation failure; this shape keeps the heuristic choice
    return false;
  }
  if (x.beta != 0.0f && x.c == x.out) CUDA_CHECK(cudaMemcpy(scratch, x.out, out_bytes, cudaMemcpyDeviceToDevice));
  std::vector<std::pair<float, size_t>> screened;  // (ms, candidate index)
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (time_algorithm(ctx, p, candidates[i], x, scratch, 1) < 0.0f) continue;  // warm-up; skips failures
    float ms = time_algorithm(ctx, p, candidates[i], x, scratch, 1);
    if (ms >= 0.0f) screened.emplace_back(ms, i);
  }
  std::sort(screened.begin(), screened.end());
  std::vector<size_t> finalists{0};
  for (const auto& [ms, i] : screened)
    if (i != 0 && finalists.size() <= static_cast<size_t>(kFinalists)) finalists.push_back(i);
  std::vector<std::vector<float>> times(finalists.size());
  for (int round = 0; round < kFinalRounds; ++round)
    for (size_t f = 0; f < finalists.size(); ++f)
      times[f].push_back(time_algorithm(ctx, p, candidates[finalists[f]], x, scratch, kRunsPerRound));
  float best = -1.0f;
  for (size_t f = 0; f < finalists.size(); ++f) {
    std::sort(times[f].begin(), times[f].end());
    float median = times[f][times[f].size() / 2];
    if (times[f].front() < 0.0f) continue;  // failed in some round
    if (best < 0.0f || median < best) {
      best = median;
      p.algo = candidates[finalists[f]];
    }
  }
  CUDA_CHECK(cudaFree(scratch));
  return best >= 0.0f;
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
                     kWorkspaceBytes};
}

static_assert(sizeof(cublasLtMatmulAlgo_t) == sizeof(GemmAlgorithm), "cuBLASLt's algorithm is 8 words");

GemmAlgorithm to_stored(const cublasLtMatmulAlgo_t& algo) {
  GemmAlgorithm stored;
  std::memcpy(stored.data(), &algo, sizeof(stored));
  return stored;
}

cublasLtMatmulAlgo_t from_stored(const GemmAlgorithm& stored) {
  cublasLtMatmulAlgo_t algo;
  std::memcpy(&algo, stored.data(), sizeof(algo));
  return algo;
}

GemmTuningTarget current_gpu_target() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  cudaDeviceProp properties{};
  CUDA_CHECK(cudaGetDeviceProperties(&properties, device));
  return GemmTuningTarget{properties.name, properties.multiProcessorCount,
                          static_cast<uint64_t>(cublasLtGetVersion())};
}

// The context's tuning cache in `directory` ("": none), opened when first asked for.
GemmTuningCache* tuning_cache(Context& ctx, const std::string& directory) {
  if (directory.empty()) {
    ctx.cache.reset();
    return nullptr;
  }
  if (!ctx.cache || ctx.cache->directory() != directory) ctx.cache.emplace(directory, current_gpu_target());
  return &*ctx.cache;
}

// Gives p the choice stored for its problem, if there is one and cuBLASLt accepts it.
bool take_stored_choice(Context& ctx, const GemmTuningCache& cache, const PlanKey& key, Plan& p) {
  std::optional<GemmAlgorithm> stored = cache.find(tuning_problem(key));
  if (!stored) return false;
  const cublasLtMatmulAlgo_t algo = from_stored(*stored);
  if (!library_accepts(ctx, p, algo)) {
    if (ctx.stats.cached_rejected++ == 0)
      log_warn("GEMM tuning cache {}: cuBLASLt rejects the stored algorithm for [{}x{}x{}]; every shape it rejects "
               "is timed again",
               cache.path(), std::get<0>(key), std::get<1>(key), std::get<2>(key));
    return false;
  }
  p.algo = algo;
  ++ctx.stats.shapes_from_cache;
  return true;
}

Plan make_plan(Context& ctx, const PlanKey& key, const Operands& operands) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero] = key;
  (void)beta_zero;  // the operands carry beta itself
  const TuningSettings settings = tuning_settings();
  Plan p = describe_problem(key);
  GemmTuningCache* cache = settings.enabled ? tuning_cache(ctx, settings.cache_directory) : nullptr;
  if (cache && take_stored_choice(ctx, *cache, key, p)) return p;

  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = kWorkspaceBytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  cublasLtMatmulHeuristicResult_t results[kHeuristicCandidates]{};
  int found = 0;
  CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx.handle, p.op, p.a, p.b, p.c, p.c, pref,
                                              settings.enabled ? kHeuristicCandidates : 1, results, &found));
  cublasLtMatmulPreferenceDestroy(pref);
  FORGE_CHECK(found > 0, "cuBLASLt has no algorithm for [{}x{}x{}] ta={} tb={} out={}", m, n, k, transpose_a,
              transpose_b, dtype_name(out_dtype));
  p.algo = results[0].algo;
  if (settings.enabled &&
      choose_by_timing(ctx, p, tuning_candidates(ctx, p, results, found), operands,
                       static_cast<size_t>(m) * static_cast<size_t>(n) * dtype_size(out_dtype))) {
    ++ctx.stats.shapes_tuned;
    if (cache) cache->add(tuning_problem(key), to_stored(p.algo));
  }
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
    if (it == ctx.plans.end()) it = ctx.plans.emplace(key, make_plan(ctx, key, {out, a, b, alpha, beta, c})).first;
    plan = &it->second;
  }
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan->op, &alpha, b, plan->a, a, plan->b, &beta, c, plan->c, out, plan->c,
                              &plan->algo, ctx.workspace, kWorkspaceBytes, nullptr));
}

CublasLtContext cublaslt_context() {
  Context& ctx = context();
  return CublasLtContext{ctx.handle, ctx.workspace, kWorkspaceBytes};
}

void set_gemm_tuning(bool enabled, const std::string& cache_directory) {  // for shapes first seen from now on
  std::lock_guard lock(g_settings_mu);
  g_settings = TuningSettings{enabled, cache_directory};
}

GemmTuningStats gemm_tuning_stats() {
  Context& ctx = context();
  std::lock_guard lock(ctx.mu);
  GemmTuningStats stats = ctx.stats;
  if (ctx.cache) {
    stats.cache_file = ctx.cache->path();
    stats.choices_loaded = static_cast<int64_t>(ctx.cache->loaded());
  }
  return stats;
}

void forget_gemm_plans() {
  Context& ctx = context();
  std::lock_guard lock(ctx.mu);
  CUDA_CHECK(cudaDeviceSynchronize());  // no GEMM in flight still reads a descriptor
  for (auto& [key, plan] : ctx.plans) destroy_plan(plan);
  ctx.plans.clear();
  ctx.cache.reset();
  ctx.stats = GemmTuningStats{};
}

}  // namespace forge::cuda
