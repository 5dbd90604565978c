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

bool matmul_epilogue(MatmulEpilogue kind, const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b,
                     bool transpose_b, float beta, const Tensor* addend, const Tensor& vector, const Tensor* aux) {
  if (out.device() != Device::CUDA) return false;
#ifdef FORGE_CUDA
  OpProfileScope profile(OpClass::Gemm, "matmul");
  FORGE_CHECK(out.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2, "matmul_epilogue: out {}, a {}, b {} must be 2-D",
              shape_str(out.shape()), shape_str(a.shape()), shape_str(b.shape()));
  const int64_t m = out.dim(0), n = out.dim(1);
  const int64_t k = transpose_a ? a.dim(0) : a.dim(1);
  check_shape(a, transpose_a ? Shape{k, m} : Shape{m, k}, "matmul_epilogue a");
  check_shape(b, transpose_b ? Shape{n, k} : Shape{k, n}, "matmul_epilogue b");
  if (profile.active())
    profile.set_detail(fmt::format("{}x{}x{} {}{} {} fused", m, n, k, transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N',
                                   dtype_name(out.dtype())));
  expect_tensor(a, Device::CUDA, DType::BF16, "matmul_epilogue a");
  expect_tensor(b, Device::CUDA, DType::BF16, "matmul_epilogue b");
  FORGE_CHECK(out.raw() != a.raw() && out.raw() != b.raw(), "matmul_epilogue: out must not alias an input");
  const bool separate_addend = addend && addend->raw() != out.raw();
  if (addend) {
    FORGE_CHECK(kind == MatmulEpilogue::Bias, "matmul_epilogue: only a bias adds an addend");
    check_shape(*addend, out.shape(), "matmul_epilogue addend");
    check_dtype(*addend, out.dtype(), "matmul_epilogue addend");
  }
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
    check_shape(*aux, out.shape(), "matmul_epilogue aux");
    expect_tensor(*aux, Device::CUDA, DType::BF16, "matmul_epilogue aux");
    FORGE_CHECK(aux->raw() != out.raw(), "matmul_epilogue: aux must not alias out");
    // cuBLASLt takes an auxiliary matrix whose leading dimension is a multiple of 8.
    if (n % 8 != 0) return false;
    e.aux = aux->raw();
  }
  bool fused = false;
  FORGE_CUDA_CALL("matmul_epilogue",
                  fused = cuda::matmul_epilogue(out.raw(), out.dtype(), a.raw(), transpose_a, b.raw(), transpose_b, m,
                                                n, k, 1.0f, beta, separate_addend ? addend->raw() : nullptr, e));
  return fused;
#else
  (void)kind, (void)a, (void)transpose_a, (void)b, (void)transpose_b, (void)beta, (void)addend, (void)vector,
      (void)aux;
  return false;
#endif
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
