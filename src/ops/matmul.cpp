#include "ops/matmul.h"

#include "kernels/cpu/matmul.h"
#include "core/device.h"
#include "core/op_profile.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/matmul.h"
#endif

namespace forge {

namespace {

// out = alpha op(a) op(b) + beta c, where c is out itself unless an addend is given.
void gemm(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, float alpha,
          float beta, const Tensor* addend, const GemmVarying* varying = nullptr) {
  OpProfileScope profile(OpClass::Gemm, "matmul");
  FORGE_CHECK(out.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2, "matmul: out {}, a {}, b {} must be 2-D",
              shape_str(out.shape()), shape_str(a.shape()), shape_str(b.shape()));
  int64_t m = out.dim(0), n = out.dim(1);
  int64_t k = transpose_a ? a.dim(0) : a.dim(1);
  check_shape(a, transpose_a ? Shape{k, m} : Shape{m, k}, "matmul a");
  check_shape(b, transpose_b ? Shape{n, k} : Shape{k, n}, "matmul b");
  if (profile.active())
    profile.set_detail(fmt::format("{}x{}x{} {}{} {}", m, n, k, transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N',
                                   dtype_name(out.dtype())));
  FORGE_CHECK(out.raw() != a.raw() && out.raw() != b.raw(), "matmul: out must not alias an input");
  FORGE_CHECK(out.device() == a.device() && out.device() == b.device(), "matmul: tensors on different devices");
  const bool separate_addend = addend && addend->raw() != out.raw();
  if (addend) {
    check_shape(*addend, out.shape(), "matmul addend");
    check_dtype(*addend, out.dtype(), "matmul addend");
    FORGE_CHECK(addend->device() == out.device(), "matmul: addend on a different device");
    FORGE_CHECK(addend->raw() != a.raw() && addend->raw() != b.raw(), "matmul: addend must not alias an input");
  }
  if (out.device() == Device::CUDA) {
    expect_tensor(a, Device::CUDA, DType::BF16, "matmul a");
    expect_tensor(b, Device::CUDA, DType::BF16, "matmul b");
    FORGE_CHECK(out.dtype() == DType::BF16 || out.dtype() == DType::F32, "matmul out is {}, expected bf16 or f32",
                dtype_name(out.dtype()));
    if (varying) {
      FORGE_CHECK(!addend, "matmul_varying: no addend");
      FORGE_CUDA_CALL("matmul",
                      cuda::matmul_varying(*varying == GemmVarying::M ? cuda::GemmVarying::M : cuda::GemmVarying::K,
                                           out.raw(), out.dtype(), a.raw(), transpose_a, b.raw(), transpose_b, m, n,
                                           k, alpha, beta));
      return;
    }
    FORGE_CUDA_CALL("matmul",
                    cuda::matmul(out.raw(), out.dtype(), a.raw(), transpose_a, b.raw(), transpose_b, m, n, k, alpha,
                                 beta, separate_addend ? addend->raw() : nullptr));
    return;
  }
  if (separate_addend) out.copy_from(*addend);
  check_dtype(out, DType::F32, "matmul out");
  check_dtype(a, DType::F32, "matmul a");
  check_dtype(b, DType::F32, "matmul b");
  cpu::matmul(out.data<float>(), a.data<float>(), transpose_a, b.data<float>(), transpose_b, m, n, k, alpha, beta);
}

}  // namespace

void matmul(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, float alpha,
            float beta) {
  gemm(out, a, transpose_a, b, transpose_b, alpha, beta, nullptr);
}

void matmul_varying(GemmVarying varying, const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b,
                    bool transpose_b, float alpha, float beta) {
  gemm(out, a, transpose_a, b, transpose_b, alpha, beta, nullptr, &varying);
}

void matmul_add(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                const Tensor& addend) {
  gemm(out, a, transpose_a, b, transpose_b, 1.0f, 1.0f, &addend);
}

ColumnBlock column_block(const Tensor& matrix, int64_t first, int64_t cols) {
  FORGE_CHECK(matrix.ndim() == 2, "column_block: matrix {} must be 2-D", shape_str(matrix.shape()));
  FORGE_CHECK(first >= 0 && cols >= 0 && first + cols <= matrix.dim(1),
              "column_block: columns [{}, {}) of a matrix {}", first, first + cols, shape_str(matrix.shape()));
  return ColumnBlock{matrix, first, cols};
}

ColumnBlock all_columns(const Tensor& matrix) {
  FORGE_CHECK(matrix.ndim() == 2, "all_columns: matrix {} must be 2-D", shape_str(matrix.shape()));
  return ColumnBlock{matrix, 0, matrix.dim(1)};
}

namespace {

Shape block_shape(const ColumnBlock& x) { return Shape{x.matrix.dim(0), x.cols}; }
bool whole(const ColumnBlock& x) { return x.first == 0 && x.cols == x.matrix.dim(1); }
// Every column of t, unchecked: check_blocks says what is wrong with a tensor that is not 2-D.
ColumnBlock whole_of(const Tensor& t) { return ColumnBlock{t, 0, t.ndim() == 2 ? t.dim(1) : 0}; }

#ifdef FORGE_CUDA
// The block's first element, and its leading dimension for the cuBLASLt layout (0 when it
// is the whole matrix); the block's start and the width in whole 16-byte units.
const void* block_pointer(const ColumnBlock& x, const char* what) {
  const size_t element = dtype_size(x.matrix.dtype());
  FORGE_CHECK(whole(x) || (x.first * element % 16 == 0 && x.matrix.dim(1) * element % 16 == 0),
              "{}: a column block on CUDA must start at a multiple of 16 bytes in a matrix whose rows are too "
              "(columns [{}, {}) of {} {})",
              what, x.first, x.first + x.cols, dtype_name(x.matrix.dtype()), shape_str(x.matrix.shape()));
  return static_cast<const char*>(x.matrix.raw()) + static_cast<size_t>(x.first) * element;
}
int64_t block_ld(const ColumnBlock& x) { return whole(x) ? 0 : x.matrix.dim(1); }
#endif

// The problem's (m, n, k) from its operands, checked as the dense GEMMs check theirs.
struct BlockProblem {
  int64_t m, n, k;
};
BlockProblem check_blocks(const char* op, const ColumnBlock& out, const Tensor& a, bool transpose_a,
                          const ColumnBlock& b, bool transpose_b, const Tensor* addend) {
  FORGE_CHECK(out.matrix.ndim() == 2 && a.ndim() == 2 && b.matrix.ndim() == 2, "{}: out {}, a {}, b {} must be 2-D",
              op, shape_str(out.matrix.shape()), shape_str(a.shape()), shape_str(b.matrix.shape()));
  const int64_t m = out.matrix.dim(0), n = out.cols, k = transpose_a ? a.dim(0) : a.dim(1);
  check_shape(a, transpose_a ? Shape{k, m} : Shape{m, k}, fmt::format("{} a", op).c_str());
  FORGE_CHECK(block_shape(b) == (transpose_b ? Shape{n, k} : Shape{k, n}), "{}: b's block {} for out's block {} and a {}",
              op, shape_str(block_shape(b)), shape_str(block_shape(out)), shape_str(a.shape()));
  FORGE_CHECK(out.matrix.raw() != a.raw() && out.matrix.raw() != b.matrix.raw(), "{}: out must not alias an input",
              op);
  FORGE_CHECK(out.matrix.device() == a.device() && out.matrix.device() == b.matrix.device(),
              "{}: tensors on different devices", op);
  if (addend) {
    FORGE_CHECK(whole(out), "{}: an addend needs out to be a whole tensor", op);
    check_shape(*addend, out.matrix.shape(), fmt::format("{} addend", op).c_str());
    check_dtype(*addend, out.matrix.dtype(), fmt::format("{} addend", op).c_str());
    FORGE_CHECK(addend->raw() != a.raw() && addend->raw() != b.matrix.raw(), "{}: addend must not alias an input", op);
  }
  return BlockProblem{m, n, k};
}

// The fused GEMM of matmul_epilogue and matmul_blocks_epilogue (NOTE [GEMM epilogues] in
// kernels/cuda/matmul.cpp); false on the CPU.
bool fused_gemm(MatmulEpilogue kind, const ColumnBlock& out_block, const Tensor& a, bool transpose_a,
                const ColumnBlock& b_block, bool transpose_b, float beta, const Tensor* addend, const Tensor& vector,
                const Tensor* aux) {
  if (out_block.matrix.device() != Device::CUDA) return false;
#ifdef FORGE_CUDA
  OpProfileScope profile(OpClass::Gemm, "matmul");
  const auto [m, n, k] = check_blocks("matmul_epilogue", out_block, a, transpose_a, b_block, transpose_b, addend);
  const Tensor& out = out_block.matrix;
  if (profile.active())
    profile.set_detail(fmt::format("{}x{}x{} {}{} {} fused{}", m, n, k, transpose_a ? 'T' : 'N',
                                   transpose_b ? 'T' : 'N', dtype_name(out.dtype()),
                                   whole(out_block) && whole(b_block) ? "" : " blocks"));
  expect_tensor(a, Device::CUDA, DType::BF16, "matmul_epilogue a");
  expect_tensor(b_block.matrix, Device::CUDA, DType::BF16, "matmul_epilogue b");
  const bool separate_addend = addend && addend->raw() != out.raw();
  if (addend) FORGE_CHECK(kind == MatmulEpilogue::Bias, "matmul_epilogue: only a bias adds an addend");
  cuda::GemmEpilogueOperands e;
  switch (kind) {
    case MatmulEpilogue::Bias:
    case MatmulEpilogue::GeluAuxBias:
      expect_tensor(out, Device::CUDA, DType::BF16, "matmul_epilogue out");
      check_shape(vector, {n}, "matmul_epilogue bias");
      expect_tensor(vector, Device::CUDA, DType::BF16, "matmul_epilogue bias");
      e.kind = kind == MatmulEpilogue::Bias ? cuda::GemmEpilogue::Bias : cuda::GemmEpilogue::GeluAuxBias;
      e.bias = vector.raw();
      break;
    case MatmulEpilogue::BiasGradient:
      FORGE_CHECK(out.dtype() == DType::BF16 || out.dtype() == DType::F32, "matmul_epilogue out is {}",
                  dtype_name(out.dtype()));
      check_shape(vector, {m}, "matmul_epilogue bias gradient");
      expect_tensor(vector, Device::CUDA, DType::F32, "matmul_epilogue bias gradient");
      e.kind = cuda::GemmEpilogue::BiasGradient;
      e.bias_gradient = vector.raw();
      break;
    case MatmulEpilogue::DGelu:
      expect_tensor(out, Device::CUDA, DType::BF16, "matmul_epilogue out");
      e.kind = cuda::GemmEpilogue::DGelu;
      break;
  }
  if (kind == MatmulEpilogue::GeluAuxBias || kind == MatmulEpilogue::DGelu) {
    FORGE_CHECK(aux != nullptr, "matmul_epilogue: GELU epilogues need aux");
    FORGE_CHECK(whole(out_block), "matmul_epilogue: a GELU epilogue's out must be a whole tensor, as its aux is");
    check_shape(*aux, out.shape(), "matmul_epilogue aux");
    expect_tensor(*aux, Device::CUDA, DType::BF16, "matmul_epilogue aux");
    FORGE_CHECK(aux->raw() != out.raw(), "matmul_epilogue: aux must not alias out");
    // cuBLASLt takes an auxiliary matrix whose leading dimension is a multiple of 8.
    if (n % 8 != 0) return false;
    e.aux = aux->raw();
  }
  const cuda::GemmLeadingDims ld{block_ld(b_block), block_ld(out_block)};
  void* out_pointer = const_cast<void*>(block_pointer(out_block, "matmul_epilogue out"));
  const void* b_pointer = block_pointer(b_block, "matmul_epilogue b");
  bool fused = false;
  FORGE_CUDA_CALL("matmul_epilogue",
                  fused = cuda::matmul_epilogue(out_pointer, out.dtype(), a.raw(), transpose_a, b_pointer, transpose_b,
                                                m, n, k, 1.0f, beta, separate_addend ? addend->raw() : nullptr, e, ld));
  return fused;
#else
  (void)kind, (void)a, (void)transpose_a, (void)b_block, (void)transpose_b, (void)beta, (void)addend, (void)vector,
      (void)aux;
  return false;
#endif
}

}  // namespace

bool matmul_epilogue(MatmulEpilogue kind, const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b,
                     bool transpose_b, float beta, const Tensor* addend, const Tensor& vector, const Tensor* aux) {
  if (out.device() != Device::CUDA) return false;
  return fused_gemm(kind, whole_of(out), a, transpose_a, whole_of(b), transpose_b, beta, addend, vector, aux);
}

bool matmul_blocks_epilogue(MatmulEpilogue kind, const ColumnBlock& out, const Tensor& a, bool transpose_a,
                            const ColumnBlock& b, bool transpose_b, float beta, const Tensor* addend,
                            const Tensor& vector, const Tensor* aux) {
  return fused_gemm(kind, out, a, transpose_a, b, transpose_b, beta, addend, vector, aux);
}

void matmul_blocks(const ColumnBlock& out, const Tensor& a, bool transpose_a, const ColumnBlock& b, bool transpose_b,
                   float beta, const Tensor* addend) {
  [[maybe_unused]] const auto [m, n, k] = check_blocks("matmul_blocks", out, a, transpose_a, b, transpose_b, addend);
  if (whole(out) && whole(b)) return gemm(out.matrix, a, transpose_a, b.matrix, transpose_b, 1.0f, beta, addend);
  if (out.matrix.device() == Device::CUDA) {
#ifdef FORGE_CUDA
    OpProfileScope profile(OpClass::Gemm, "matmul");
    if (profile.active())
      profile.set_detail(fmt::format("{}x{}x{} {}{} {} blocks", m, n, k, transpose_a ? 'T' : 'N',
                                     transpose_b ? 'T' : 'N', dtype_name(out.matrix.dtype())));
    expect_tensor(a, Device::CUDA, DType::BF16, "matmul_blocks a");
    expect_tensor(b.matrix, Device::CUDA, DType::BF16, "matmul_blocks b");
    FORGE_CHECK(out.matrix.dtype() == DType::BF16 || out.matrix.dtype() == DType::F32,
                "matmul_blocks out is {}, expected bf16 or f32", dtype_name(out.matrix.dtype()));
    const cuda::GemmLeadingDims ld{block_ld(b), block_ld(out)};
    void* out_pointer = const_cast<void*>(block_pointer(out, "matmul_blocks out"));
    const void* b_pointer = block_pointer(b, "matmul_blocks b");
    const bool separate_addend = addend && addend->raw() != out.matrix.raw();
    FORGE_CUDA_CALL("matmul_blocks", cuda::matmul(out_pointer, out.matrix.dtype(), a.raw(), transpose_a, b_pointer,
                                                  transpose_b, m, n, k, 1.0f, beta,
                                                  separate_addend ? addend->raw() : nullptr, ld));
#endif
    return;
  }
  // The CPU reference: the blocks as dense tensors (NOTE [Column blocks]).
  auto dense = [](const ColumnBlock& x, bool read) {
    if (whole(x)) return x.matrix;
    Tensor t = Tensor::empty(block_shape(x), x.matrix.dtype(), Device::CPU);
    if (read) copy_columns(t, 0, x.matrix, x.first, x.cols);
    return t;
  };
  const Tensor out_dense = dense(out, beta != 0.0f && !addend);
  gemm(out_dense, a, transpose_a, dense(b, true), transpose_b, 1.0f, beta, addend);
  if (!whole(out)) copy_columns(out.matrix, out.first, out_dense, 0, out.cols);
}

void matmul_batched(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                    float alpha, float beta) {
  OpProfileScope profile(OpClass::Gemm, "matmul");
  FORGE_CHECK(out.ndim() == 3 && a.ndim() == 3 && b.ndim() == 3, "matmul_batched: out {}, a {}, b {} must be 3-D",
              shape_str(out.shape()), shape_str(a.shape()), shape_str(b.shape()));
  const int64_t batch = out.dim(0), m = out.dim(1), n = out.dim(2);
  const int64_t k = transpose_a ? a.dim(1) : a.dim(2);
  check_shape(a, transpose_a ? Shape{batch, k, m} : Shape{batch, m, k}, "matmul_batched a");
  check_shape(b, transpose_b ? Shape{batch, n, k} : Shape{batch, k, n}, "matmul_batched b");
  if (profile.active())
    profile.set_detail(fmt::format("{} x {}x{}x{} {}{} {}", batch, m, n, k, transpose_a ? 'T' : 'N',
                                   transpose_b ? 'T' : 'N', dtype_name(out.dtype())));
  FORGE_CHECK(out.raw() != a.raw() && out.raw() != b.raw(), "matmul_batched: out must not alias an input");
  FORGE_CHECK(out.device() == a.device() && out.device() == b.device(), "matmul_batched: tensors on different devices");
  if (out.device() == Device::CUDA) {
    expect_tensor(a, Device::CUDA, DType::BF16, "matmul_batched a");
    expect_tensor(b, Device::CUDA, DType::BF16, "matmul_batched b");
    FORGE_CHECK(out.dtype() == DType::BF16 || out.dtype() == DType::F32,
                "matmul_batched out is {}, expected bf16 or f32", dtype_name(out.dtype()));
    FORGE_CUDA_CALL("matmul_batched", cuda::matmul_batched(out.raw(), out.dtype(), a.raw(), transpose_a, b.raw(),
                                                           transpose_b, m, n, k, batch, alpha, beta));
    return;
  }
  check_dtype(out, DType::F32, "matmul_batched out");
  check_dtype(a, DType::F32, "matmul_batched a");
  check_dtype(b, DType::F32, "matmul_batched b");
  for (int64_t i = 0; i < batch; ++i)
    cpu::matmul(out.data<float>() + i * m * n, a.data<float>() + i * m * k, transpose_a, b.data<float>() + i * k * n,
                transpose_b, m, n, k, alpha, beta);
}

void set_gemm_tuning(bool enabled, const std::string& cache_directory) {
#ifdef FORGE_CUDA
  if (cuda_available()) cuda::set_gemm_tuning(enabled, cache_directory);
#else
  (void)enabled;
  (void)cache_directory;
#endif
}

GemmTuningStats gemm_tuning_stats() {
#ifdef FORGE_CUDA
  if (cuda_available()) return cuda::gemm_tuning_stats();
#endif
  return GemmTuningStats{};
}

}  // namespace forge
