// How far cuBLASLt's heuristic is from the best algorithm configuration it can run, on the
// GEMM shapes of the 8B-shape proxy (a measurement tool behind NOTE [GEMM algorithm
// choice] in src/kernels/cuda/matmul.cpp; forge itself does not use it).
//
// For each shape (forge's row-major matmul: m x n x k, transposes, output dtype, beta) it
// compares four ways of picking cuBLASLt's algorithm configuration:
//   heur1     the heuristic's first choice (forge without training.gemm_tuning);
//   heur16    the fastest of the heuristic's first 16 candidates;
//   variants  the heuristic's 16 plus its first 8 with every cluster shape of 1x1, 2x1,
//             1x2 and every custom option the algorithm accepts;
//   tiles     the heuristic's 16 plus its first with every tile size, those cluster
//             shapes and custom options (at most [max timed] of them, evenly spread).
// Every candidate that cublasLtMatmulAlgoCheck accepts is screened with one warm-up and
// one timed run; each strategy's 4 fastest are then timed together, round robin, 5 rounds
// of 3 runs, and each strategy's best median is printed with its gain over heur1 and the
// winner's configuration. Operands hold random values (zeros draw less power, run faster).
//
//   nvcc -O2 -std=c++17 -arch=sm_90a scripts/gemm-search.cu -lcublasLt -o /tmp/gemm-search
//   /tmp/gemm-search [max timed per strategy, default 600]
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));   \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)
#define CHECK_LT(x)                                                                      \
  do {                                                                                   \
    cublasStatus_t s_ = (x);                                                             \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      std::fprintf(stderr, "%s:%d cublas status %d\n", __FILE__, __LINE__, int(s_));    \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

namespace {

constexpr size_t kWorkspace = 32u << 20;

struct Shape {
  const char* name;
  long m, n, k;
  bool ta, tb, f32_out;
  float beta;
};

__global__ void fill_random(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    unsigned x = unsigned(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = __float2bfloat16((float(x & 0xffff) / 65536.0f - 0.5f) * 0.2f);
  }
}

struct Problem {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, c;
  void *A, *B, *C, *ws;
  float alpha = 1.0f, beta;
};

float time_runs(Problem& p, const cublasLtMatmulAlgo_t& algo, int runs) {
  cudaEvent_t s, e;
  CHECK_CUDA(cudaEventCreate(&s));
  CHECK_CUDA(cudaEventCreate(&e));
  CHECK_CUDA(cudaEventRecord(s));
  for (int i = 0; i < runs; ++i) {
    if (cublasLtMatmul(p.h, p.op, &p.alpha, p.A, p.a, p.B, p.b, &p.beta, p.C, p.c, p.C, p.c, &algo, p.ws, kWorkspace,
                       nullptr) != CUBLAS_STATUS_SUCCESS) {
      cudaEventDestroy(s);
      cudaEventDestroy(e);
      return -1.0f;
    }
  }
  CHECK_CUDA(cudaEventRecord(e));
  CHECK_CUDA(cudaEventSynchronize(e));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, s, e));
  cudaEventDestroy(s);
  cudaEventDestroy(e);
  return ms / runs;
}

void describe(const cublasLtMatmulAlgo_t& algo, char* out, size_t size) {
  int id = 0;
  uint32_t tile = 0, stages = 0, swizzle = 0, custom = 0, splitk = 0;
  uint16_t cluster = 0;
  size_t w;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof(id), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &w);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &w);
  std::snprintf(out, size, "id %d tile %u stages %u cluster %u swz %u custom %u splitk %u", id, tile, stages,
                unsigned(cluster), swizzle, custom, splitk);
}

template <typename T> std::vector<T> cap_list(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t attr) {
  size_t bytes = 0;
  if (cublasLtMatmulAlgoCapGetAttribute(&algo, attr, nullptr, 0, &bytes) != CUBLAS_STATUS_SUCCESS || bytes == 0)
    return {};
  std::vector<T> v(bytes / sizeof(T));
  cublasLtMatmulAlgoCapGetAttribute(&algo, attr, v.data(), bytes, &bytes);
  return v;
}

struct Timed {
  cublasLtMatmulAlgo_t algo;
  float ms;
};

float median_of(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void search(cublasLtHandle_t h, const Shape& s, void* ws, int max_timed) {
  // Row-major C[m,n] = op(a) op(b) is column-major C^T = op(b)^T op(a)^T (NOTE [Row-major
  // GEMM on a column-major library] in src/kernels/cuda/matmul.cpp).
  Problem p{};
  p.h = h;
  p.ws = ws;
  p.beta = s.beta;
  cudaDataType_t ct = s.f32_out ? CUDA_R_32F : CUDA_R_16BF;
  CHECK_LT(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t first = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N, second = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &first, sizeof(first)));
  CHECK_LT(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &second, sizeof(second)));
  if (s.tb)
    CHECK_LT(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, s.k, s.n, s.k));
  else
    CHECK_LT(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, s.n, s.k, s.n));
  if (s.ta)
    CHECK_LT(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, s.m, s.k, s.m));
  else
    CHECK_LT(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, s.k, s.m, s.k));
  CHECK_LT(cublasLtMatrixLayoutCreate(&p.c, ct, s.n, s.m, s.n));
  size_t a_elems = size_t(s.n) * s.k, b_elems = size_t(s.m) * s.k, c_bytes = size_t(s.m) * s.n * (s.f32_out ? 4 : 2);
  CHECK_CUDA(cudaMalloc(&p.A, a_elems * 2));
  CHECK_CUDA(cudaMalloc(&p.B, b_elems * 2));
  CHECK_CUDA(cudaMalloc(&p.C, c_bytes));
  fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p.A), a_elems, 1u);
  fill_random<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p.B), b_elems, 2u);
  CHECK_CUDA(cudaMemset(p.C, 0, c_bytes));

  // The heuristic's first 16.
  cublasLtMatmulPreference_t pref;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  size_t wsb = kWorkspace;
  CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb)));
  cublasLtMatmulHeuristicResult_t heur[16]{};
  int found = 0;
  CHECK_LT(cublasLtMatmulAlgoGetHeuristic(h, p.op, p.a, p.b, p.c, p.c, pref, 16, heur, &found));
  cublasLtMatmulPreferenceDestroy(pref);

  std::vector<cublasLtMatmulAlgo_t> heuristic;
  for (int i = 0; i < found; ++i) heuristic.push_back(heur[i].algo);

  // Strategy "variants": each of the heuristic's first 8 with every custom option and
  // cluster shapes 1x1, 2x1, 1x2 (tile and stages kept).
  const uint16_t variant_clusters[] = {CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                                       CUBLASLT_CLUSTER_SHAPE_1x2x1};
  std::vector<cublasLtMatmulAlgo_t> variants = heuristic;
  for (int i = 0; i < std::min(found, 8); ++i) {
    int32_t custom_max = 0;
    size_t w;
    cublasLtMatmulAlgoCapGetAttribute(&heur[i].algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max,
                                      sizeof(custom_max), &w);
    for (uint16_t cluster : variant_clusters)
      for (int32_t custom = 0; custom <= std::min(custom_max, 7); ++custom) {
        cublasLtMatmulAlgo_t a = heur[i].algo;
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster));
        cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom));
        cublasLtMatmulHeuristicResult_t r{};
        if (cublasLtMatmulAlgoCheck(h, p.op, p.a, p.b, p.c, p.c, &a, &r) != CUBLAS_STATUS_SUCCESS) continue;
        if (r.workspaceSize > kWorkspace) continue;
        variants.push_back(a);
      }
  }

  // Strategy "tiles": the heuristic's first with every tile, cluster 1x1/2x1/1x2, custom option.
  std::vector<cublasLtMatmulAlgo_t> tiles_sweep = heuristic;
  {
    auto tiles = cap_list<uint32_t>(heur[0].algo, CUBLASLT_ALGO_CAP_TILE_IDS);
    int32_t custom_max = 0;
    size_t w;
    cublasLtMatmulAlgoCapGetAttribute(&heur[0].algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max,
                                      sizeof(custom_max), &w);
    for (uint32_t tile : tiles)
      for (uint16_t cluster : variant_clusters)
        for (int32_t custom = 0; custom <= std::min(custom_max, 7); ++custom) {
          cublasLtMatmulAlgo_t a = heur[0].algo;
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster));
          cublasLtMatmulAlgoConfigSetAttribute(&a, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom));
          cublasLtMatmulHeuristicResult_t r{};
          if (cublasLtMatmulAlgoCheck(h, p.op, p.a, p.b, p.c, p.c, &a, &r) != CUBLAS_STATUS_SUCCESS) continue;
          if (r.workspaceSize > kWorkspace) continue;
          tiles_sweep.push_back(a);
        }
  }
  if (int(tiles_sweep.size()) > max_timed) {
    std::vector<cublasLtMatmulAlgo_t> spread(heuristic);
    for (int i = 0; i < max_timed; ++i) spread.push_back(tiles_sweep[size_t(i) * tiles_sweep.size() / max_timed]);
    tiles_sweep.swap(spread);
  }

  // Screen: one warm-up and one timed run each; the 4 fastest of each strategy go on.
  auto screen = [&](const std::vector<cublasLtMatmulAlgo_t>& cands) {
    std::vector<Timed> t;
    for (auto& a : cands) {
      if (time_runs(p, a, 1) < 0) continue;
      float ms = time_runs(p, a, 1);
      if (ms > 0) t.push_back({a, ms});
    }
    std::sort(t.begin(), t.end(), [](auto& x, auto& y) { return x.ms < y.ms; });
    if (t.size() > 4) t.resize(4);
    return t;
  };
  std::vector<std::vector<Timed>> finalists = {{{heur[0].algo, 0}}, screen(heuristic), screen(variants),
                                               screen(tiles_sweep)};
  const char* names[] = {"heur1", "heur16", "variants", "tiles"};
  size_t counts[] = {1, heuristic.size(), variants.size(), tiles_sweep.size()};
  // Round robin over all finalists, 5 rounds of 3 runs; each strategy's best median.
  std::vector<std::vector<std::vector<float>>> samples(finalists.size());
  for (size_t s2 = 0; s2 < finalists.size(); ++s2) samples[s2].resize(finalists[s2].size());
  for (int round = 0; round < 5; ++round)
    for (size_t s2 = 0; s2 < finalists.size(); ++s2)
      for (size_t i = 0; i < finalists[s2].size(); ++i)
        samples[s2][i].push_back(time_runs(p, finalists[s2][i].algo, 3));
  double flop = 2.0 * s.m * s.n * s.k;
  std::printf("%-12s %6ldx%6ldx%6ld ta%d tb%d %s b%.0f |", s.name, s.m, s.n, s.k, s.ta, s.tb, s.f32_out ? "f32" : "bf16",
              s.beta);
  float base = 0;
  std::vector<cublasLtMatmulAlgo_t> winners;
  for (size_t s2 = 0; s2 < finalists.size(); ++s2) {
    float best = 1e30f;
    cublasLtMatmulAlgo_t win{};
    for (size_t i = 0; i < finalists[s2].size(); ++i) {
      float m = median_of(samples[s2][i]);
      if (m < best) best = m, win = finalists[s2][i].algo;
    }
    if (s2 == 0) base = best;
    winners.push_back(win);
    std::printf(" %s(%zu) %.3f ms %.0f TF %+.1f%% |", names[s2], counts[s2], best, flop / best / 1e9,
                100.0 * (base - best) / base);
  }
  std::printf("\n");
  for (size_t s2 = 0; s2 < winners.size(); ++s2) {
    char d[160];
    describe(winners[s2], d, sizeof d);
    std::printf("    %-8s: %s\n", names[s2], d);
  }
  std::fflush(stdout);
  cudaFree(p.A);
  cudaFree(p.B);
  cudaFree(p.C);
  cublasLtMatrixLayoutDestroy(p.a);
  cublasLtMatrixLayoutDestroy(p.b);
  cublasLtMatrixLayoutDestroy(p.c);
  cublasLtMatmulDescDestroy(p.op);
}

}  // namespace

int main(int argc, char** argv) {
  int max_timed = argc > 1 ? std::atoi(argv[1]) : 600;
  cublasLtHandle_t h;
  CHECK_LT(cublasLtCreate(&h));
  void* ws;
  CHECK_CUDA(cudaMalloc(&ws, kWorkspace));
  const long T = 8192, H = 4096, QKV = 6144, F2 = 28672, F = 14336, V = 128256;
  // forge's calls in src/model/ (its block components and the head), per micro-batch of 8192 tokens.
  const Shape shapes[] = {
      {"qkv fwd", T, QKV, H, false, true, false, 0},   {"o fwd", T, H, H, false, true, false, 1},
      {"gate_up fwd", T, F2, H, false, true, false, 0}, {"down fwd", T, H, F, false, true, false, 1},
      {"head fwd", T, V, H, false, true, false, 0},     {"qkv dX", T, H, QKV, false, false, false, 0},
      {"o dX", T, H, H, false, false, false, 0},         {"gate_up dX", T, H, F2, false, false, false, 0},
      {"down dX", T, F, H, false, false, false, 0},      {"head dX", T, H, V, false, false, false, 0},
      {"qkv dW", QKV, H, T, true, false, true, 1},       {"o dW", H, H, T, true, false, true, 1},
      {"gate_up dW", F2, H, T, true, false, true, 1},    {"down dW", H, F, T, true, false, true, 1},
      {"head dW", V, H, T, true, false, true, 1},
  };
  for (const Shape& s : shapes) search(h, s, ws, max_timed);
  return 0;
}
