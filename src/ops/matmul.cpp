#include "ops/matmul.h"

#include "kernels/cpu/matmul.h"

namespace forge {

void matmul(const Tensor& out, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b, float alpha,
            float beta) {
  FORGE_CHECK(out.ndim() == 2 && a.ndim() == 2 && b.ndim() == 2, "matmul: out {}, a {}, b {} must be 2-D",
              shape_str(out.shape()), shape_str(a.shape()), shape_str(b.shape()));
  check_dtype(out, DType::F32, "matmul out");
  check_dtype(a, DType::F32, "matmul a");
  check_dtype(b, DType::F32, "matmul b");
  int64_t m = out.dim(0), n = out.dim(1);
  int64_t k = transpose_a ? a.dim(0) : a.dim(1);
  check_shape(a, transpose_a ? Shape{k, m} : Shape{m, k}, "matmul a");
  check_shape(b, transpose_b ? Shape{n, k} : Shape{k, n}, "matmul b");
  FORGE_CHECK(out.raw() != a.raw() && out.raw() != b.raw(), "matmul: out must not alias an input");
  FORGE_CHECK(out.device() == a.device() && out.device() == b.device(), "matmul: tensors on different devices");
  FORGE_CHECK(out.device() == Device::CPU, "matmul: no CUDA kernel in this build");
  cpu::matmul(out.data<float>(), a.data<float>(), transpose_a, b.data<float>(), transpose_b, m, n, k, alpha, beta);
}

}  // namespace forge
