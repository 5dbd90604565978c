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
// NOTE [GEMMs of varying size]
// A routed expert's GEMMs see a different row count nearly every step, so keyed by exact
// shape each would make a new plan (a heuristic query, or with tuning a timing) on most
// calls, and keep it forever. matmul_varying keys the plan by the varying dimension
// rounded up to a multiple of kVaryingBucket instead: the first call of a bucket chooses
// the algorithm for its own size (on its own operands, as any plan), and later calls of
// the bucket set their size on the plan's layouts (CUBLASLT_MATRIX_LAYOUT_ROWS/COLS) and
// run the same algorithm. A size the algorithm does not take (cuBLASLt refuses the call
// before launching anything) gets a plan of its own, kept in the bucket's place. The
// varying dimension is never a leading dimension in forge's three uses, so only the
// layouts' row or column counts change.
//
// NOTE [Batched GEMMs]
// matmul_batched runs `batch` problems of one shape whose operands lie one after another in
// memory (a Mixture-of-Experts layer whose experts all have the same rows: padding to
// capacity, NOTE [MoE capacity] in ops/moe.h) as one cuBLASLt call: each layout gets
// CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT and a STRIDED_BATCH_OFFSET of one matrix's elements,
// so one launch covers every expert instead of one per expert. Its plans are kept per
// (shape, batch) and take cuBLASLt's first heuristic algorithm: the tuning cache keys
// single problems, so training.gemm_tuning does not measure these.
//
// The timing costs seconds per run (10.8 s of the 8B proxy's first step on an H100), so
// measured choices are kept on disk and taken by later runs on the same GPU model and
// cuBLASLt version (NOTE [GEMM tuning cache] in kernels/gemm_tuning_cache.h): a tuned plan
// first looks there, runs the stored algorithm past cublasLtMatmulAlgoCheck for its
// problem, and only times candidates when there is none or cuBLASLt rejects it; each
// shape timed is added to the file at once. A side effect worth having: runs that share
// a cache take the same algorithms, so they round alike, where each run's own timing
// could pick differently.
//
// NOTE [GEMM epilogues]
// A layer with a bias (FLUX's) would otherwise pay a pass over its output after each GEMM
// (add the bias), one over dy for its gradient (column sums) and, before and after a GELU,
// one more each way. cuBLASLt folds them into the GEMM that writes or reads the tensor
// anyway: Bias adds a bf16 vector to every row of out; GeluAuxBias writes gelu_tanh(x W^T
// + b) as out and the pre-activation (the backward's input) as `aux`; BiasGradient writes
// (never adds) the sums over k of op(a), one per row of out: with a = dy transposed that is
// the bias gradient, computed while the weight gradient dy^T x is; DGelu turns the GEMM's
// result g into g * gelu_tanh'(aux), the gradient at the pre-activation. In cuBLASLt's column-major
// view (NOTE [Row-major GEMM on a column-major library]) forge's a is its B, so the
// gradient of a's sums is BGRADB, and a vector per column of out is one per row of its D.
// The fused GELU backward is DGELU alone: DGELU_BGRAD, which would also give the previous
// layer's bias gradient, has no algorithm on the H200 (cuBLAS 13.0) for a bf16 output with
// an fp32 bias gradient, and that gradient comes fused anyway with the previous layer's
// weight gradient (BGRADB).
// An epilogue is part of the plan's key and of the tuning cache's (GemmProblem::epilogue).
// cuBLASLt does not fuse every combination of layouts and types: when it has no algorithm
// for one, matmul_epilogue runs nothing, remembers the refusal and returns false, and the
// caller runs its separate passes (ops/linear.cpp), so a fused problem is never an error.
//
// NOTE [Column-block GEMMs]
// A linear layer over two concatenated inputs (FLUX's single blocks: [attention, GELU(MLP)]
// through one output projection, NOTE [Linear over concatenated inputs] in ops/linear.h)
// multiplies each input by a column block of its weight W [out, in1 + in2] and writes its
// weight gradient's column blocks, instead of copying the inputs into one [rows, in1 + in2]
// tensor and the input gradient out of one. A column block of a row-major matrix is a
// matrix whose rows are the whole matrix's width apart: in cuBLASLt's column-major view a
// layout whose leading dimension is that width instead of the block's own, starting at the
// block's first element. forge's tensors stay dense (NOTE [Contiguous tensors]); the
// leading dimensions enter here only, as GemmLeadingDims for b and for out (the operands
// the linear layer splits: the weight, and the weight gradient), 0 meaning dense. They are
// part of the plan's key and of the tuning cache's (GemmProblem::ld_b, ld_out), so a block
// never takes a dense problem's algorithm unchecked; the timing's scratch output spans the
// block's rows at their leading dimension. cuBLASLt takes any leading dimension at least
// the block's width; forge's blocks start at multiples of 8 elements, so their rows keep
// the 16-byte alignment the fast kernels want.
#include "kernels/cuda/matmul.h"

#include <cublasLt.h>

#include <climits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

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
  int64_t varying_size = 0;  // a varying plan's size on its layouts now
};

// (m, n, k, transpose_a, transpose_b, out dtype, beta == 0, epilogue, ld of b, ld of out),
// the leading dimensions 0 for dense operands (NOTE [Column-block GEMMs])
using PlanKey = std::tuple<int64_t, int64_t, int64_t, bool, bool, DType, bool, GemmEpilogue, int64_t, int64_t>;

// A call's leading dimensions with a dense operand's as 0, so that a block as wide as its
// matrix shares the dense problem's plan.
GemmLeadingDims normalized(GemmLeadingDims ld, int64_t n, int64_t k, bool transpose_b) {
  const int64_t b_width = transpose_b ? k : n;
  FORGE_CHECK(ld.b == 0 || ld.b >= b_width, "matmul: b's leading dimension {} is narrower than its {} columns", ld.b,
              b_width);
  FORGE_CHECK(ld.out == 0 || ld.out >= n, "matmul: out's leading dimension {} is narrower than its {} columns", ld.out,
              n);
  return GemmLeadingDims{ld.b == b_width ? 0 : ld.b, ld.out == n ? 0 : ld.out};
}

// The bytes from out's first element to its last (its rows at their leading dimension).
size_t output_span_bytes(int64_t m, int64_t n, int64_t ld_out, DType out_dtype) {
  const int64_t ld = ld_out ? ld_out : n;
  return static_cast<size_t>((m - 1) * ld + n) * dtype_size(out_dtype);
}

constexpr int64_t kVaryingBucket = 256;  // NOTE [GEMMs of varying size]

struct Context {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, Plan> plans;
  std::map<std::pair<PlanKey, GemmVarying>, Plan> varying_plans;  // by bucket (NOTE [GEMMs of varying size])
  std::map<std::pair<PlanKey, int64_t>, Plan> batched_plans;        // by batch count (NOTE [Batched GEMMs])
  std::map<PlanKey, Plan> epilogue_plans;    // NOTE [GEMM epilogues]
  std::map<PlanKey, bool> epilogue_refused;  // fused problems cuBLASLt has no algorithm for (NOTE [GEMM epilogues])
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

cublasLtEpilogue_t cublaslt_epilogue(GemmEpilogue e) {
  switch (e) {
    case GemmEpilogue::None: return CUBLASLT_EPILOGUE_DEFAULT;
    case GemmEpilogue::Bias: return CUBLASLT_EPILOGUE_BIAS;
    case GemmEpilogue::GeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case GemmEpilogue::BiasGradient: return CUBLASLT_EPILOGUE_BGRADB;  // forge's a is cuBLASLt's B
    case GemmEpilogue::DGelu: return CUBLASLT_EPILOGUE_DGELU;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

// The epilogue and what does not change between calls: the bias vector's type (bf16 added
// to a bf16 output; fp32 gradients) and the auxiliary matrix's leading dimension, which is
// the output's (cuBLASLt's D is n x m, column-major).
void set_epilogue_kind(cublasLtMatmulDesc_t op, GemmEpilogue e, int64_t n) {
  if (e == GemmEpilogue::None) return;
  const cublasLtEpilogue_t epilogue = cublaslt_epilogue(e);
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
  if (e != GemmEpilogue::DGelu) {
    const cudaDataType_t bias_type = e == GemmEpilogue::BiasGradient ? CUDA_R_32F : CUDA_R_16BF;
    CUBLAS_CHECK(
        cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
  }
  if (e == GemmEpilogue::GeluAuxBias || e == GemmEpilogue::DGelu) {
    const int64_t ld = n;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld)));
  }
}

// A call's epilogue pointers on its plan's descriptor (set under the context's lock, just
// before the launch that reads them).
void set_epilogue_pointers(cublasLtMatmulDesc_t op, const GemmEpilogueOperands& e) {
  if (e.kind == GemmEpilogue::None) return;
  if (e.kind != GemmEpilogue::DGelu) {
    const void* bias = e.kind == GemmEpilogue::BiasGradient ? e.bias_gradient : e.bias;
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }
  if (e.kind == GemmEpilogue::GeluAuxBias || e.kind == GemmEpilogue::DGelu)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux, sizeof(e.aux)));
}

// The plan's descriptors for the column-major problem (N, M, K), without an algorithm:
// the first operand is b, the second a.
Plan describe_problem(const PlanKey& key) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero, epilogue, ld_b, ld_out] = key;
  (void)beta_zero;  // it decides the algorithm, not the descriptors
  Plan p;
  cudaDataType_t c_type = out_dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, kComputeType, CUDA_R_32F));
  cublasOperation_t op_first = transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t op_second = transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  // Stored shapes (rows x cols, column-major, ld = rows unless a column block's,
  // NOTE [Column-block GEMMs]).
  if (transpose_b)
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, ld_b ? ld_b : k));
  else
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, n, k, ld_b ? ld_b : n));
  if (transpose_a)
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, m, k, m));
  else
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, c_type, n, m, ld_out ? ld_out : n));
  set_epilogue_kind(p.op, epilogue, n);
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
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero, epilogue, ld_b, ld_out] = key;
  return GemmProblem{m, n, k, transpose_a, transpose_b, DType::BF16, out_dtype, beta_zero, kComputeType,
                     kWorkspaceBytes, std::nullopt,
                     epilogue == GemmEpilogue::None ? 0 : static_cast<int32_t>(cublaslt_epilogue(epilogue)), ld_b,
                     ld_out};
}

// The plan for a problem seen for the first time, its algorithm chosen on the call's own
// operands (out, a, b in forge's roles; cuBLASLt's A is b, its B is a).
// Nothing when cuBLASLt has none (`epilogue`: the call's epilogue pointers, set on the
// descriptor before the algorithm is chosen).
std::optional<Plan> try_make_plan(Context& ctx, const PlanKey& key, void* out, const void* a, const void* b,
                                  float alpha, float beta, const void* c, const GemmEpilogueOperands& epilogue) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero, kind, ld_b, ld_out] = key;
  (void)beta_zero, (void)k, (void)transpose_a, (void)transpose_b, (void)kind, (void)ld_b;  // the operands carry beta
  Plan p = describe_problem(key);
  set_epilogue_pointers(p.op, epilogue);
  const CublasLtOperands operands{b, a, c, out, alpha, beta, output_span_bytes(m, n, ld_out, out_dtype)};
  const std::optional<cublasLtMatmulAlgo_t> algo =
      choose_gemm_algorithm(CublasLtContext{ctx.handle, ctx.workspace, kWorkspaceBytes}, {p.op, p.a, p.b, p.c, p.c},
                            operands, tuning_problem(key));
  if (!algo) {
    destroy_plan(p);
    return std::nullopt;
  }
  p.algo = *algo;
  return p;
}

Plan make_plan(Context& ctx, const PlanKey& key, void* out, const void* a, const void* b, float alpha, float beta,
               const void* c) {
  std::optional<Plan> p = try_make_plan(ctx, key, out, a, b, alpha, beta, c, GemmEpilogueOperands{});
  FORGE_CHECK(p.has_value(), "cuBLASLt has no algorithm for [{}x{}x{}] ta={} tb={} out={}", std::get<0>(key),
              std::get<1>(key), std::get<2>(key), std::get<3>(key), std::get<4>(key), dtype_name(std::get<5>(key)));
  return *p;
}

}  // namespace

void matmul(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b, int64_t m,
            int64_t n, int64_t k, float alpha, float beta, const void* addend, GemmLeadingDims ld) {
  if (m == 0 || n == 0) return;
  ld = normalized(ld, n, k, transpose_b);
  FORGE_CHECK(!(addend && ld.out), "matmul: an addend needs a dense out");
  const void* c = addend ? addend : out;
  Context& ctx = context();
  PlanKey key{m, n, k, transpose_a, transpose_b, out_dtype, beta == 0.0f, GemmEpilogue::None, ld.b, ld.out};
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

bool matmul_epilogue(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b,
                     int64_t m, int64_t n, int64_t k, float alpha, float beta, const void* addend,
                     const GemmEpilogueOperands& epilogue, GemmLeadingDims ld) {
  if (epilogue.kind == GemmEpilogue::None) {
    matmul(out, out_dtype, a, transpose_a, b, transpose_b, m, n, k, alpha, beta, addend, ld);
    return true;
  }
  if (m == 0 || n == 0) return false;  // nothing to fuse into: the caller's own passes handle the edge
  ld = normalized(ld, n, k, transpose_b);
  FORGE_CHECK(!(addend && ld.out), "matmul_epilogue: an addend needs a dense out");
  const void* c = addend ? addend : out;
  Context& ctx = context();
  const PlanKey key{m, n, k, transpose_a, transpose_b, out_dtype, beta == 0.0f, epilogue.kind, ld.b, ld.out};
  std::lock_guard lock(ctx.mu);  // the epilogue pointers are set on the shared descriptor per call
  if (ctx.epilogue_refused.count(key)) return false;
  auto it = ctx.epilogue_plans.find(key);
  if (it == ctx.epilogue_plans.end()) {
    std::optional<Plan> plan = try_make_plan(ctx, key, out, a, b, alpha, beta, c, epilogue);
    if (!plan) {
      ctx.epilogue_refused[key] = true;
      return false;
    }
    it = ctx.epilogue_plans.emplace(key, *plan).first;
  }
  const Plan& plan = it->second;
  set_epilogue_pointers(plan.op, epilogue);
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan.op, &alpha, b, plan.a, a, plan.b, &beta, c, plan.c, out, plan.c,
                              &plan.algo, ctx.workspace, kWorkspaceBytes, nullptr));
  return true;
}

namespace {

// Sets a varying plan's layouts to `size` in its varying dimension (the plan's problem is
// cuBLAS's (N, M, K): C is n x m, the first operand b, the second a; describe_problem).
void set_varying_size(Plan& p, GemmVarying varying, bool transpose_a, bool transpose_b, int64_t size) {
  auto set = [](cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t what, int64_t value) {
    const uint64_t v = static_cast<uint64_t>(value);
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, what, &v, sizeof(v)));
  };
  if (varying == GemmVarying::M) {
    set(p.c, CUBLASLT_MATRIX_LAYOUT_COLS, size);
    set(p.b, transpose_a ? CUBLASLT_MATRIX_LAYOUT_ROWS : CUBLASLT_MATRIX_LAYOUT_COLS, size);
  } else {
    set(p.a, transpose_b ? CUBLASLT_MATRIX_LAYOUT_ROWS : CUBLASLT_MATRIX_LAYOUT_COLS, size);
    set(p.b, transpose_a ? CUBLASLT_MATRIX_LAYOUT_COLS : CUBLASLT_MATRIX_LAYOUT_ROWS, size);
  }
  p.varying_size = size;
}

}  // namespace

void matmul_varying(GemmVarying varying, void* out, DType out_dtype, const void* a, bool transpose_a, const void* b,
                    bool transpose_b, int64_t m, int64_t n, int64_t k, float alpha, float beta) {
  if (varying == GemmVarying::None) return matmul(out, out_dtype, a, transpose_a, b, transpose_b, m, n, k, alpha, beta);
  if (m == 0 || n == 0) return;
  const int64_t size = varying == GemmVarying::M ? m : k;
  const int64_t bucket = (size + kVaryingBucket - 1) / kVaryingBucket * kVaryingBucket;
  Context& ctx = context();
  const PlanKey key{m, n, k, transpose_a, transpose_b, out_dtype, beta == 0.0f, GemmEpilogue::None, 0, 0};
  PlanKey bucket_key = key;
  (varying == GemmVarying::M ? std::get<0>(bucket_key) : std::get<2>(bucket_key)) = bucket;
  std::lock_guard lock(ctx.mu);  // the plan's layouts change per call: held through the launch
  auto it = ctx.varying_plans.find({bucket_key, varying});
  if (it == ctx.varying_plans.end()) {
    it = ctx.varying_plans.emplace(std::pair{bucket_key, varying}, make_plan(ctx, key, out, a, b, alpha, beta, out)).first;
    it->second.varying_size = size;
  }
  Plan& plan = it->second;
  if (plan.varying_size != size) set_varying_size(plan, varying, transpose_a, transpose_b, size);
  cublasStatus_t status = cublasLtMatmul(ctx.handle, plan.op, &alpha, b, plan.a, a, plan.b, &beta, out, plan.c, out,
                                         plan.c, &plan.algo, ctx.workspace, kWorkspaceBytes, nullptr);
  if (status == CUBLAS_STATUS_SUCCESS) return;
  // The bucket's algorithm does not take this size: a plan of this size in its place.
  destroy_plan(plan);
  plan = make_plan(ctx, key, out, a, b, alpha, beta, out);
  plan.varying_size = size;
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan.op, &alpha, b, plan.a, a, plan.b, &beta, out, plan.c, out, plan.c,
                              &plan.algo, ctx.workspace, kWorkspaceBytes, nullptr));
}

namespace {

// A batched plan (NOTE [Batched GEMMs]): the problem's layouts, each with the batch count
// and one matrix's elements as its stride, and the heuristic's first algorithm.
Plan make_batched_plan(Context& ctx, const PlanKey& key, int64_t batch) {
  auto [m, n, k, transpose_a, transpose_b, out_dtype, beta_zero, epilogue, ld_b, ld_out] = key;
  (void)transpose_a, (void)transpose_b, (void)out_dtype, (void)beta_zero, (void)epilogue, (void)ld_b, (void)ld_out;
  Plan p = describe_problem(key);
  auto set_batch = [&](cublasLtMatrixLayout_t layout, int64_t stride) {
    const int32_t count = static_cast<int32_t>(batch);
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    CUBLAS_CHECK(
        cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
  };
  set_batch(p.a, n * k);  // cuBLASLt's A is forge's b
  set_batch(p.b, m * k);
  set_batch(p.c, m * n);
  const std::vector<cublasLtMatmulHeuristicResult_t> found =
      heuristic_algorithms(CublasLtContext{ctx.handle, ctx.workspace, kWorkspaceBytes}, {p.op, p.a, p.b, p.c, p.c}, 1);
  if (found.empty()) destroy_plan(p);
  FORGE_CHECK(!found.empty(), "cuBLASLt has no algorithm for {} batched [{}x{}x{}] ta={} tb={} out={}", batch, m, n,
              k, std::get<3>(key), std::get<4>(key), dtype_name(std::get<5>(key)));
  p.algo = found.front().algo;
  return p;
}

}  // namespace

void matmul_batched(void* out, DType out_dtype, const void* a, bool transpose_a, const void* b, bool transpose_b,
                    int64_t m, int64_t n, int64_t k, int64_t batch, float alpha, float beta) {
  if (m == 0 || n == 0 || batch == 0) return;
  FORGE_CHECK(batch <= INT32_MAX, "matmul_batched: {} matrices (cuBLASLt counts them in int32)", batch);
  Context& ctx = context();
  const PlanKey key{m, n, k, transpose_a, transpose_b, out_dtype, beta == 0.0f, GemmEpilogue::None, 0, 0};
  const Plan* plan;
  {
    std::lock_guard lock(ctx.mu);
    auto it = ctx.batched_plans.find({key, batch});
    if (it == ctx.batched_plans.end()) it = ctx.batched_plans.emplace(std::pair{key, batch}, make_batched_plan(ctx, key, batch)).first;
    plan = &it->second;
  }
  CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan->op, &alpha, b, plan->a, a, plan->b, &beta, out, plan->c, out, plan->c,
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
    for (auto& [key, plan] : ctx.varying_plans) destroy_plan(plan);
    ctx.varying_plans.clear();
    for (auto& [key, plan] : ctx.batched_plans) destroy_plan(plan);
    ctx.batched_plans.clear();
    for (auto& [key, plan] : ctx.epilogue_plans) destroy_plan(plan);
    ctx.epilogue_plans.clear();
    ctx.epilogue_refused.clear();
  }
  forget_fp8_gemm_plans();
  forget_gemm_tuning_state();
}

}  // namespace forge::cuda
