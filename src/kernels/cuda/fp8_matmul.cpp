// Scaled FP8 GEMM through cuBLASLt (NOTE [FP8 GEMM layout] and NOTE [FP8 GEMM scale modes
// on sm_90] in fp8_matmul.h).
//
// As in matmul.cpp (NOTE [Row-major GEMM on a column-major library]), the row-major
// out[M, N] = a[M, K] @ b[N, K]^T is the column-major out^T[N, M] = b a^T: cuBLASLt's A is
// b, stored K x N column-major (ld K) and transposed, its B is a, stored K x M (ld K) and
// not transposed: the "TN" layout Hopper's FP8 kernels require. A's dequantization factors
// are therefore b's, B's are a's. The handle and the 32 MiB workspace are matmul.cpp's
// (kernels/cuda/cublaslt_context.h). Each (shape, formats, scale modes, output, beta == 0,
// fast accumulation) gets its algorithm on first use and keeps it, chosen as the bf16
// GEMMs' are (NOTE [GEMM algorithm choice] in matmul.cpp, kernels/cuda/gemm_tuner.h):
// cuBLASLt's first heuristic choice, or with training.gemm_tuning the fastest candidate
// timed on the call's own codes and factors (into a scratch copy of the output), kept in
// the same tuning cache file as an fp8gemm entry keyed on all of the above
// (NOTE [GEMM tuning cache]).
// The factor pointers change from call to call, so they are set on the plan's descriptor
// just before each cublasLtMatmul, under the plans' lock; the first call sets them before
// its algorithm is chosen, so the heuristic and every timing run see the call's own.
//
// NOTE [FP8 GEMMs of varying size]
// A routed expert's FP8 GEMMs (NOTE [FP8 routed experts] in ops/moe_fp8.h) see a new row
// count on most calls: keyed by exact shape, each call would pay a heuristic query (with
// training.gemm_tuning, a timing) and keep one more plan forever; on the DeepSeek-V2-Lite
// proxy (64 experts, 3 MoE blocks) that made FP8 2.4x slower than bf16 (docs/PERF.md,
// 2026-12-03). As the bf16 GEMMs (NOTE [GEMMs of varying size] in matmul.cpp), a varying
// call's plan is kept per bucket of kVaryingBucket in the varying dimension: the bucket's
// first call chooses the algorithm for its own size, later calls set their size on the
// layouts and run it. In the TN layout the varying M is the column count of cuBLASLt's B
// (our a) and of C; the varying K (the weight gradient's tokens, padded to 16) is the row
// count and the leading dimension of both operands. A size the algorithm refuses (cuBLASLt
// returns an error before launching anything) gets a plan of its own in the bucket's place.
#include "kernels/cuda/fp8_matmul.h"

#include <cublasLt.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/cublaslt_context.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/gemm_tuner.h"

namespace forge::cuda {
namespace {

constexpr int64_t kBlock = 128;

struct Problem {
  DType out_dtype;
  Fp8Format a_format, b_format;
  Fp8GemmScaling a_scaling, b_scaling;
  int64_t m, n, k;
  bool beta_zero, fast_accumulation;

  auto key() const {
    return std::tuple(out_dtype, a_format, b_format, a_scaling, b_scaling, m, n, k, beta_zero, fast_accumulation);
  }
  bool operator<(const Problem& o) const { return key() < o.key(); }
};

struct Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;  // cuBLASLt's A (our b), B (our a), C = D
  cublasLtMatmulAlgo_t algo{};
  int64_t varying_size = 0;  // the size the layouts hold (NOTE [FP8 GEMMs of varying size])
};

constexpr int64_t kVaryingBucket = 256;  // as matmul.cpp's

cudaDataType_t cuda_type(Fp8Format format) { return format == Fp8Format::E4M3 ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2; }

int32_t scale_mode(Fp8GemmScaling scaling) {
  switch (scaling) {
    case Fp8GemmScaling::Tensor: return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
    case Fp8GemmScaling::Row: return CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    case Fp8GemmScaling::Block1x128: return CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    case Fp8GemmScaling::Block128x128: return CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
  }
  return CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F;
}

bool is_block(Fp8GemmScaling s) { return s == Fp8GemmScaling::Block1x128 || s == Fp8GemmScaling::Block128x128; }

// What cuBLASLt cannot run on sm_90, in words; "" when the problem is one it documents.
std::string refusal(const Problem& p) {
  if (p.out_dtype != DType::BF16 && p.out_dtype != DType::F32)
    return fmt::format("the output is {}, expected bf16 or f32", dtype_name(p.out_dtype));
  if (p.a_format == Fp8Format::E5M2 && p.b_format == Fp8Format::E5M2) return "both operands are E5M2";
  if (p.k % 16 != 0) return fmt::format("k = {} is not a multiple of 16", p.k);
  if (p.n * static_cast<int64_t>(dtype_size(p.out_dtype)) % 16 != 0)
    return fmt::format("n = {} rows of {} output are not a multiple of 16 bytes", p.n, dtype_name(p.out_dtype));
  const bool row_a = p.a_scaling == Fp8GemmScaling::Row, row_b = p.b_scaling == Fp8GemmScaling::Row;
  if (row_a != row_b) return "row scaling must be set for both operands";
  if (is_block(p.a_scaling) != is_block(p.b_scaling)) return "block scaling must be set for both operands";
  if (p.a_scaling == Fp8GemmScaling::Block128x128 && p.b_scaling == Fp8GemmScaling::Block128x128)
    return "128x128 blocks on both operands are not supported";
  if (is_block(p.a_scaling) && (p.m % 4 != 0 || p.n % 4 != 0))
    return fmt::format("block scaling needs m and n multiples of 4, got m = {}, n = {}", p.m, p.n);
  if (is_block(p.a_scaling) && p.fast_accumulation) return "block scaling does not allow fast accumulation";
  return "";
}

Plan describe(const Problem& p) {
  Plan plan;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof(transpose)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof(none)));
  const int32_t mode_a = scale_mode(p.b_scaling), mode_b = scale_mode(p.a_scaling);
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
  const int8_t fast = p.fast_accumulation ? 1 : 0;
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.a, cuda_type(p.b_format), p.k, p.n, p.k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.b, cuda_type(p.a_format), p.k, p.m, p.k));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan.c, p.out_dtype == DType::F32 ? CUDA_R_32F : CUDA_R_16BF, p.n, p.m,
                                          p.n));
  return plan;
}

void destroy(Plan& plan) {
  cublasLtMatrixLayoutDestroy(plan.c);
  cublasLtMatrixLayoutDestroy(plan.b);
  cublasLtMatrixLayoutDestroy(plan.a);
  cublasLtMatmulDescDestroy(plan.op);
}

// Points cuBLASLt's A and B scale factors (our b's and a's) at `b_factors` / `a_factors`.
void set_factors(Plan& plan, const void* a_factors, const void* b_factors) {
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b_factors,
                                              sizeof(b_factors)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a_factors,
                                              sizeof(a_factors)));
}

CublasLtDescriptors descriptors(const Plan& plan) { return {plan.op, plan.a, plan.b, plan.c, plan.c}; }

// The key of a problem's choice in the GEMM tuning cache: forge's row-major a @ b^T.
GemmProblem tuning_problem(const Problem& p, const CublasLtContext& ctx) {
  const GemmFp8Inputs fp8{p.a_format, p.b_format, scale_mode(p.a_scaling), scale_mode(p.b_scaling),
                          p.fast_accumulation};
  return GemmProblem{p.m, p.n, p.k, false, true, DType::U8, p.out_dtype, p.beta_zero, CUBLAS_COMPUTE_32F,
                     ctx.workspace_bytes, fp8};
}

// The algorithm for the plan, chosen on the call's own operands (NOTE [GEMM algorithm
// choice]), if cuBLASLt has one. The scale pointers are set first, as Transformer Engine and
// PyTorch do before their heuristic queries: a null pointer means "factor 1" only in the
// per-tensor mode, and the outer-vector and block modes found no algorithm on the H100
// while they were null (docs/PERF.md; to be confirmed there); the timing runs need them too.
bool find_algorithm(const CublasLtContext& ctx, Plan& plan, const Problem& p, void* out, const Fp8GemmOperand& a,
                    const Fp8GemmOperand& b, float alpha, float beta) {
  set_factors(plan, a.factors, b.factors);
  const CublasLtOperands operands{b.codes, a.codes, out, out, alpha, beta,
                                  static_cast<size_t>(p.m) * static_cast<size_t>(p.n) * dtype_size(p.out_dtype)};
  const std::optional<cublasLtMatmulAlgo_t> algo =
      choose_gemm_algorithm(ctx, descriptors(plan), operands, tuning_problem(p, ctx));
  if (!algo) return false;
  plan.algo = *algo;
  return true;
}

struct Plans {
  std::mutex mu;
  std::map<std::pair<int, Problem>, Plan> plans;  // (GPU, problem); kept for the life of the process
  // (GPU, the problem with its varying size rounded up to the bucket, which size varies)
  std::map<std::tuple<int, Problem, GemmVarying>, Plan> varying_plans;  // NOTE [FP8 GEMMs of varying size]
};

// The layouts of a varying plan set to `size` (NOTE [FP8 GEMMs of varying size]).
void set_varying_size(Plan& plan, GemmVarying varying, int64_t size) {
  auto set = [](cublasLtMatrixLayout_t layout, cublasLtMatrixLayoutAttribute_t what, int64_t value) {
    const uint64_t v = static_cast<uint64_t>(value);
    CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, what, &v, sizeof(v)));
  };
  if (varying == GemmVarying::M) {
    set(plan.b, CUBLASLT_MATRIX_LAYOUT_COLS, size);
    set(plan.c, CUBLASLT_MATRIX_LAYOUT_COLS, size);
  } else {
    for (cublasLtMatrixLayout_t layout : {plan.a, plan.b}) {
      set(layout, CUBLASLT_MATRIX_LAYOUT_ROWS, size);
      set(layout, CUBLASLT_MATRIX_LAYOUT_LD, size);
    }
  }
  plan.varying_size = size;
}

Plans& plans() {
  static Plans* p = new Plans();  // never destroyed: destroying descriptors at exit races the driver
  return *p;
}

std::string describe_problem(const Problem& p) {
  return fmt::format("FP8 GEMM [{}x{}x{}] a {} {}, b {} {}, out {}{}", p.m, p.n, p.k, cpu::fp8_format_name(p.a_format),
                     fp8_gemm_scaling_name(p.a_scaling), cpu::fp8_format_name(p.b_format),
                     fp8_gemm_scaling_name(p.b_scaling), dtype_name(p.out_dtype),
                     p.fast_accumulation ? ", fast accumulation" : "");
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace

const char* fp8_gemm_scaling_name(Fp8GemmScaling scaling) {
  switch (scaling) {
    case Fp8GemmScaling::Tensor: return "tensorwise";
    case Fp8GemmScaling::Row: return "rowwise";
    case Fp8GemmScaling::Block1x128: return "1x128 blocks";
    case Fp8GemmScaling::Block128x128: return "128x128 blocks";
  }
  return "?";
}

void fp8_matmul(void* out, DType out_dtype, const Fp8GemmOperand& a, const Fp8GemmOperand& b, int64_t m, int64_t n,
                int64_t k, float alpha, float beta, bool fast_accumulation, GemmVarying varying) {
  const Problem p{out_dtype, a.format, b.format, a.scaling, b.scaling, m, n, k, beta == 0.0f, fast_accumulation};
  const std::string why = refusal(p);
  FORGE_CHECK(why.empty(), "{}: {}", describe_problem(p), why);
  FORGE_CHECK(aligned(out, 16) && aligned(a.codes, 16) && aligned(b.codes, 16),
              "{}: the output and the codes must start 16-byte aligned", describe_problem(p));
  // 16 bytes for every mode: the block factors by cuBLAS's documentation (3.1.4.5.1), the
  // per-tensor ones as measured on the H100 (GpuFp8Gemm.ScalePointerAlignment: 4, 8, 12
  // and 20 bytes past a 256-byte boundary were refused with CUBLAS_STATUS_NOT_SUPPORTED,
  // 16 and its multiples ran).
  constexpr size_t factor_alignment = 16;
  FORGE_CHECK(aligned(a.factors, factor_alignment) && aligned(b.factors, factor_alignment),
              "{}: the factors must start {}-byte aligned", describe_problem(p), factor_alignment);
  if (m == 0 || n == 0) return;
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const CublasLtContext ctx = cublaslt_context();
  Plans& all = plans();
  std::lock_guard lock(all.mu);  // a plan's factors (and a varying plan's layouts) change per call
  auto new_plan = [&] {
    Plan plan = describe(p);
    if (!find_algorithm(ctx, plan, p, out, a, b, alpha, beta)) {
      destroy(plan);
      throw_error(__FILE__, __LINE__, describe_problem(p) + ": cuBLASLt has no algorithm for it on this GPU");
    }
    return plan;
  };
  auto run = [&](Plan& plan) {
    set_factors(plan, a.factors, b.factors);
    return cublasLtMatmul(ctx.handle, plan.op, &alpha, b.codes, plan.a, a.codes, plan.b, &beta, out, plan.c, out,
                          plan.c, &plan.algo, ctx.workspace, ctx.workspace_bytes, nullptr);
  };
  auto fail = [&](cublasStatus_t status) {
    throw_error(__FILE__, __LINE__,
                fmt::format("{}: cublasLtMatmul returned status {} (output {}, codes {} / {}, factors {} / {})",
                            describe_problem(p), static_cast<int>(status), out, static_cast<const void*>(a.codes),
                            static_cast<const void*>(b.codes), static_cast<const void*>(a.factors),
                            static_cast<const void*>(b.factors)));
  };
  if (a.scaling != Fp8GemmScaling::Tensor || b.scaling != Fp8GemmScaling::Tensor) varying = GemmVarying::None;
  if (varying == GemmVarying::None) {
    auto it = all.plans.find({device, p});
    if (it == all.plans.end()) it = all.plans.emplace(std::pair{device, p}, new_plan()).first;
    if (const cublasStatus_t status = run(it->second); status != CUBLAS_STATUS_SUCCESS) fail(status);
    return;
  }
  // NOTE [FP8 GEMMs of varying size]
  const int64_t size = varying == GemmVarying::M ? m : k;
  Problem bucket = p;
  (varying == GemmVarying::M ? bucket.m : bucket.k) = (size + kVaryingBucket - 1) / kVaryingBucket * kVaryingBucket;
  auto it = all.varying_plans.find({device, bucket, varying});
  if (it == all.varying_plans.end()) {
    it = all.varying_plans.emplace(std::tuple{device, bucket, varying}, new_plan()).first;
    it->second.varying_size = size;
  }
  Plan& plan = it->second;
  if (plan.varying_size != size) set_varying_size(plan, varying, size);
  if (run(plan) == CUBLAS_STATUS_SUCCESS) return;
  destroy(plan);  // the bucket's algorithm does not take this size: a plan of this size in its place
  plan = new_plan();
  plan.varying_size = size;
  if (const cublasStatus_t status = run(plan); status != CUBLAS_STATUS_SUCCESS) fail(status);
}

bool fp8_matmul_supported(DType out_dtype, Fp8Format a_format, Fp8GemmScaling a_scaling, Fp8Format b_format,
                          Fp8GemmScaling b_scaling, int64_t m, int64_t n, int64_t k, bool fast_accumulation) {
  const Problem p{out_dtype, a_format, b_format, a_scaling, b_scaling, m, n, k, true, fast_accumulation};
  if (!refusal(p).empty() || m == 0 || n == 0) return false;
  // No factors exist yet: the workspace stands in for them (device memory, 256-byte aligned).
  const CublasLtContext ctx = cublaslt_context();
  Plan plan = describe(p);
  set_factors(plan, ctx.workspace, ctx.workspace);
  const bool found = !heuristic_algorithms(ctx, descriptors(plan), 1).empty();
  destroy(plan);
  return found;
}

void forget_fp8_gemm_plans() {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  Plans& all = plans();
  std::lock_guard lock(all.mu);
  CUDA_CHECK(cudaDeviceSynchronize());  // no GEMM in flight still reads a descriptor
  for (auto it = all.plans.begin(); it != all.plans.end();) {
    if (it->first.first != device) {
      ++it;
      continue;
    }
    destroy(it->second);
    it = all.plans.erase(it);
  }
  for (auto it = all.varying_plans.begin(); it != all.varying_plans.end();) {
    if (std::get<0>(it->first) != device) {
      ++it;
      continue;
    }
    destroy(it->second);
    it = all.varying_plans.erase(it);
  }
}

int64_t fp8_gemm_factor_count(int64_t rows, int64_t k, Fp8GemmScaling scaling) {
  const int64_t k_blocks = (k + kBlock - 1) / kBlock;
  switch (scaling) {
    case Fp8GemmScaling::Tensor: return 1;
    case Fp8GemmScaling::Row: return rows;
    case Fp8GemmScaling::Block1x128: return k_blocks * rows;
    case Fp8GemmScaling::Block128x128: return (rows + kBlock - 1) / kBlock * ((k_blocks + 3) / 4 * 4);
  }
  return 0;
}

std::vector<float> fp8_gemm_factor_layout(const float* grid, int64_t rows, int64_t k, Fp8GemmScaling scaling) {
  std::vector<float> out(static_cast<size_t>(fp8_gemm_factor_count(rows, k, scaling)), 0.0f);
  const int64_t k_blocks = (k + kBlock - 1) / kBlock;
  switch (scaling) {
    case Fp8GemmScaling::Tensor:
    case Fp8GemmScaling::Row:
      for (size_t i = 0; i < out.size(); ++i) out[i] = grid[i];
      break;
    case Fp8GemmScaling::Block1x128:  // grid [rows][k_blocks] -> [k_blocks][rows]
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < k_blocks; ++b) out[static_cast<size_t>(b * rows + r)] = grid[r * k_blocks + b];
      break;
    case Fp8GemmScaling::Block128x128: {  // grid [row_blocks][k_blocks] -> [row_blocks][L4]
      const int64_t padded = (k_blocks + 3) / 4 * 4;
      for (int64_t p = 0; p < (rows + kBlock - 1) / kBlock; ++p)
        for (int64_t b = 0; b < k_blocks; ++b) out[static_cast<size_t>(p * padded + b)] = grid[p * k_blocks + b];
      break;
    }
  }
  return out;
}

}  // namespace forge::cuda
