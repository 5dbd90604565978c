#include "ops/rmsnorm.h"

#include "kernels/cpu/rmsnorm.h"

namespace forge {
namespace {

void check_f32_cpu(const Tensor& t, const char* what) {
  check_dtype(t, DType::F32, what);
  FORGE_CHECK(t.device() == Device::CPU, "{}: no CUDA kernel in this build", what);
}

}  // namespace

void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps) {
  FORGE_CHECK(x.ndim() == 2, "rmsnorm_forward: x {} must be [N, D]", shape_str(x.shape()));
  int64_t rows = x.dim(0), dim = x.dim(1);
  check_shape(y, x.shape(), "rmsnorm_forward y");
  check_shape(rstd, {rows}, "rmsnorm_forward rstd");
  check_shape(weight, {dim}, "rmsnorm_forward weight");
  check_f32_cpu(y, "rmsnorm_forward y");
  check_f32_cpu(rstd, "rmsnorm_forward rstd");
  check_f32_cpu(x, "rmsnorm_forward x");
  check_f32_cpu(weight, "rmsnorm_forward weight");
  cpu::rmsnorm_forward(y.data<float>(), rstd.data<float>(), x.data<float>(), weight.data<float>(), rows, dim, eps);
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd) {
  FORGE_CHECK(x.ndim() == 2, "rmsnorm_backward: x {} must be [N, D]", shape_str(x.shape()));
  int64_t rows = x.dim(0), dim = x.dim(1);
  check_shape(dx, x.shape(), "rmsnorm_backward dx");
  check_shape(dy, x.shape(), "rmsnorm_backward dy");
  check_shape(dweight, {dim}, "rmsnorm_backward dweight");
  check_shape(weight, {dim}, "rmsnorm_backward weight");
  check_shape(rstd, {rows}, "rmsnorm_backward rstd");
  check_f32_cpu(dx, "rmsnorm_backward dx");
  check_f32_cpu(dweight, "rmsnorm_backward dweight");
  check_f32_cpu(dy, "rmsnorm_backward dy");
  check_f32_cpu(x, "rmsnorm_backward x");
  check_f32_cpu(weight, "rmsnorm_backward weight");
  check_f32_cpu(rstd, "rmsnorm_backward rstd");
  cpu::rmsnorm_backward(dx.data<float>(), dweight.data<float>(), dy.data<float>(), x.data<float>(),
                        weight.data<float>(), rstd.data<float>(), rows, dim);
}

}  // namespace forge
