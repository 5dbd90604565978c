// Measured selection of cuBLASLt algorithms and its on-disk cache, for any cuBLASLt problem
// (NOTE [GEMM algorithm choice] in matmul.cpp says what is timed and why). The settings and
// the tuning cache are per process and per GPU, shared by the bf16 and FP8 GEMMs: one
// switch (set_gemm_tuning), one file per GPU model and cuBLASLt version, one set of counters.
#include "kernels/cuda/gemm_tuner.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "core/log.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/matmul.h"

namespace forge::cuda {
namespace {

constexpr int kHeuristicCandidates = 16;
constexpr int kVariedCandidates = 4;  // of the heuristic's, varied in cluster shape and custom option
constexpr int kFinalists = 4;
constexpr int kFinalRounds = 5;
constexpr int kRunsPerRound = 2;

struct TuningSettings {
  bool enabled = false;
  std::string cache_directory;  // where measured choices are kept; "" keeps none
};

std::mutex g_settings_mu;
TuningSettings g_settings;  // set_gemm_tuning, for every GPU

TuningSettings tuning_settings() {
  std::lock_guard lock(g_settings_mu);
  return g_settings;
}

// One GPU's measured choices: its cache file, opened by the first tuned problem, and the
// counters of how its problems were chosen.
struct TuningState {
  std::mutex mu;  // one choice at a time on this GPU, bf16 and FP8 alike
  std::optional<GemmTuningCache> cache;
  GemmTuningStats stats;
};

TuningState& tuning_state() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mu;
  static std::map<int, TuningState*> states;  // live for the process, as the GEMM contexts
  std::lock_guard lock(mu);
  TuningState*& state = states[device];
  if (!state) state = new TuningState();
  return *state;
}

// Milliseconds per run of one candidate over `runs` runs, or a negative value when it
// fails to run. The output is `scratch`; C is the scratch too when the call is in place.
float time_algorithm(const CublasLtContext& ctx, const CublasLtDescriptors& p, const cublasLtMatmulAlgo_t& algo,
                     const CublasLtOperands& x, void* scratch, int runs) {
  const void* c = x.c == x.d ? scratch : x.c;
  auto run = [&] {
    return cublasLtMatmul(ctx.handle, p.op, &x.alpha, x.a, p.a, x.b, p.b, &x.beta, c, p.c, scratch, p.d, &algo,
                          ctx.workspace, ctx.workspace_bytes, nullptr);
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

// Whether cuBLASLt runs `algo` for the problem within the workspace.
bool library_accepts(const CublasLtContext& ctx, const CublasLtDescriptors& p, const cublasLtMatmulAlgo_t& algo) {
  cublasLtMatmulHeuristicResult_t check{};
  return cublasLtMatmulAlgoCheck(ctx.handle, p.op, p.a, p.b, p.c, p.d, &algo, &check) == CUBLAS_STATUS_SUCCESS &&
         check.workspaceSize <= ctx.workspace_bytes;
}

// The heuristic's candidates, then variants of its first kVariedCandidates: every cluster
// shape of 1x1, 2x1, 1x2 with every custom option, where cuBLASLt accepts the combination.
std::vector<cublasLtMatmulAlgo_t> tuning_candidates(const CublasLtContext& ctx, const CublasLtDescriptors& p,
                                                    const std::vector<cublasLtMatmulHeuristicResult_t>& heuristic) {
  std::vector<cublasLtMatmulAlgo_t> candidates;
  for (const cublasLtMatmulHeuristicResult_t& result : heuristic) candidates.push_back(result.algo);
  const uint16_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                               CUBLASLT_CLUSTER_SHAPE_1x2x1};
  for (size_t i = 0; i < std::min(heuristic.size(), static_cast<size_t>(kVariedCandidates)); ++i) {
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
// Nothing when nothing could be timed (the problem then keeps the heuristic's choice).
std::optional<cublasLtMatmulAlgo_t> choose_by_timing(const CublasLtContext& ctx, const CublasLtDescriptors& p,
                                                     const std::vector<cublasLtMatmulAlgo_t>& candidates,
                                                     const CublasLtOperands& x) {
  void* scratch = nullptr;
  if (cudaMalloc(&scratch, x.d_bytes) != cudaSuccess) {
    cudaGetLastError();  // clear the allocation failure; this problem keeps the heuristic choice
    return std::nullopt;
  }
  if (x.beta != 0.0f && x.c == x.d) CUDA_CHECK(cudaMemcpy(scratch, x.d, x.d_bytes, cudaMemcpyDeviceToDevice));
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
  std::optional<cublasLtMatmulAlgo_t> fastest;
  for (size_t f = 0; f < finalists.size(); ++f) {
    std::sort(times[f].begin(), times[f].end());
    float median = times[f][times[f].size() / 2];
    if (times[f].front() < 0.0f) continue;  // failed in some round
    if (best < 0.0f || median < best) {
      best = median;
      fastest = candidates[finalists[f]];
    }
  }
  CUDA_CHECK(cudaFree(scratch));
  return fastest;
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

// The GPU's tuning cache in `directory` ("": none), opened when first asked for.
GemmTuningCache* tuning_cache(TuningState& state, const std::string& directory) {
  if (directory.empty()) {
    state.cache.reset();
    return nullptr;
  }
  if (!state.cache || state.cache->directory() != directory) state.cache.emplace(directory, current_gpu_target());
  return &*state.cache;
}

// The choice stored for the problem, if there is one and cuBLASLt accepts it.
std::optional<cublasLtMatmulAlgo_t> stored_choice(const CublasLtContext& ctx, TuningState& state,
                                                  const GemmTuningCache& cache, const CublasLtDescriptors& p,
                                                  const GemmProblem& key) {
  std::optional<GemmAlgorithm> stored = cache.find(key);
  if (!stored) return std::nullopt;
  const cublasLtMatmulAlgo_t algo = from_stored(*stored);
  if (!library_accepts(ctx, p, algo)) {
    if (state.stats.cached_rejected++ == 0)
      log_warn("GEMM tuning cache {}: cuBLASLt rejects the stored algorithm for {}[{}x{}x{}]; every shape it "
               "rejects is timed again",
               cache.path(), key.fp8 ? "FP8 " : "", key.m, key.n, key.k);
    return std::nullopt;
  }
  ++state.stats.shapes_from_cache;
  return algo;
}

}  // namespace

std::vector<cublasLtMatmulHeuristicResult_t> heuristic_algorithms(const CublasLtContext& ctx,
                                                                  const CublasLtDescriptors& p, int count) {
  cublasLtMatmulPreference_t pref;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  size_t ws = ctx.workspace_bytes;
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(count));
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(ctx.handle, p.op, p.a, p.b, p.c, p.d, pref, count, results.data(), &found);
  cublasLtMatmulPreferenceDestroy(pref);
  results.resize(status == CUBLAS_STATUS_SUCCESS ? static_cast<size_t>(found) : 0);
  return results;
}

std::optional<cublasLtMatmulAlgo_t> choose_gemm_algorithm(const CublasLtContext& ctx, const CublasLtDescriptors& p,
                                                          const CublasLtOperands& x, const GemmProblem& key) {
  const TuningSettings settings = tuning_settings();
  if (!settings.enabled) {
    const std::vector<cublasLtMatmulHeuristicResult_t> first = heuristic_algorithms(ctx, p, 1);
    if (first.empty()) return std::nullopt;
    return first[0].algo;
  }
  TuningState& state = tuning_state();
  std::lock_guard lock(state.mu);
  GemmTuningCache* cache = tuning_cache(state, settings.cache_directory);
  if (cache)
    if (std::optional<cublasLtMatmulAlgo_t> stored = stored_choice(ctx, state, *cache, p, key)) return stored;
  const std::vector<cublasLtMatmulHeuristicResult_t> heuristic = heuristic_algorithms(ctx, p, kHeuristicCandidates);
  if (heuristic.empty()) return std::nullopt;
  std::optional<cublasLtMatmulAlgo_t> fastest = choose_by_timing(ctx, p, tuning_candidates(ctx, p, heuristic), x);
  if (!fastest) return heuristic[0].algo;
  ++state.stats.shapes_tuned;
  if (cache) cache->add(key, to_stored(*fastest));
  return fastest;
}

void forget_gemm_tuning_state() {
  TuningState& state = tuning_state();
  std::lock_guard lock(state.mu);
  state.cache.reset();
  state.stats = GemmTuningStats{};
}

void set_gemm_tuning(bool enabled, const std::string& cache_directory) {  // for problems first seen from now on
  std::lock_guard lock(g_settings_mu);
  g_settings = TuningSettings{enabled, cache_directory};
}

GemmTuningStats gemm_tuning_stats() {
  TuningState& state = tuning_state();
  std::lock_guard lock(state.mu);
  GemmTuningStats stats = state.stats;
  if (state.cache) {
    stats.cache_file = state.cache->path();
    stats.choices_loaded = static_cast<int64_t>(state.cache->loaded());
  }
  return stats;
}

}  // namespace forge::cuda
