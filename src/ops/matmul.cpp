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
