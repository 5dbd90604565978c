#include "ops/rmsnorm.h"

#include "kernels/cpu/rmsnorm.h"
#include "core/op_profile.h"
#include "ops/linear.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/rmsnorm.h"
#endif

namespace forge {
void rmsnorm_forward(const Tensor& y, const Tensor& rstd, const Tensor& x, const Tensor& weight, float eps,
                     const LinearWeight* feeds) {
  OpProfileScope profile(OpClass::Elementwise, "rmsnorm_forward");
  FORGE_CHECK(x.ndim() == 2, "rmsnorm_forward: x {} must be [N, D]", shape_str(x.shape()));
  int64_t rows = x.dim(0), dim = x.dim(1);
  check_shape(y, x.shape(), "rmsnorm_forward y");
  check_shape(rstd, {rows}, "rmsnorm_forward rstd");
  check_shape(weight, {dim}, "rmsnorm_forward weight");
  if (x.device() == Device::CUDA) {
    expect_tensor(y, Device::CUDA, DType::BF16, "rmsnorm_forward y");
    expect_tensor(rstd, Device::CUDA, DType::F32, "rmsnorm_forward rstd");
    expect_tensor(x, Device::CUDA, DType::BF16, "rmsnorm_forward x");
    expect_tensor(weight, Device::CUDA, DType::BF16, "rmsnorm_forward weight");
    const cuda::Fp8Epilogue fp8 = fp8_input_epilogue(y, feeds ? feeds->fp8 : nullptr);
    FORGE_CUDA_CALL("rmsnorm_forward",
                    cuda::rmsnorm_forward(static_cast<cuda::bf16*>(y.raw()), rstd.data<float>(),
                                          static_cast<const cuda::bf16*>(x.raw()),
                                          static_cast<const cuda::bf16*>(weight.raw()), rows, dim, eps, fp8));
    return;
  }
  expect_tensor(y, Device::CPU, DType::F32, "rmsnorm_forward y");
  expect_tensor(rstd, Device::CPU, DType::F32, "rmsnorm_forward rstd");
  expect_tensor(x, Device::CPU, DType::F32, "rmsnorm_forward x");
  expect_tensor(weight, Device::CPU, DType::F32, "rmsnorm_forward weight");
  cpu::rmsnorm_forward(y.data<float>(), rstd.data<float>(), x.data<float>(), weight.data<float>(), rows, dim, eps);
}

void rmsnorm_backward(const Tensor& dx, const Tensor& dweight, const Tensor& dy, const Tensor& x,
                      const Tensor& weight, const Tensor& rstd) {
  OpProfileScope profile(OpClass::Elementwise, "rmsnorm_backward");
  FORGE_CHECK(x.ndim() == 2, "rmsnorm_backward: x {} must be [N, D]", shape_str(x.shape()));
  int64_t rows = x.dim(0), dim = x.dim(1);
  check_shape(dx, x.shape(), "rmsnorm_backward dx");
  check_shape(dy, x.shape(), "rmsnorm_backward dy");
  check_shape(dweight, {dim}, "rmsnorm_backward dweight");
  check_shape(weight, {dim}, "rmsnorm_backward weight");
  check_shape(rstd, {rows}, "rmsnorm_backward rstd");
  if (x.device() == Device::CUDA) {
    expect_tensor(dx, Device::CUDA, DType::BF16, "rmsnorm_backward dx");
    expect_tensor(dweight, Device::CUDA, DType::F32, "rmsnorm_backward dweight");
    expect_tensor(dy, Device::CUDA, DType::BF16, "rmsnorm_backward dy");
    expect_tensor(x, Device::CUDA, DType::BF16, "rmsnorm_backward x");
    expect_tensor(weight, Device::CUDA, DType::BF16, "rmsnorm_backward weight");
    expect_tensor(rstd, Device::CUDA, DType::F32, "rmsnorm_backward rstd");
    FORGE_CUDA_CALL("rmsnorm_backward",
                    cuda::rmsnorm_backward(static_cast<cuda::bf16*>(dx.raw()), dweight.data<float>(),
                                           static_cast<const cuda::bf16*>(dy.raw()),
                                           static_cast<const cuda::bf16*>(x.raw()),
                                           static_cast<const cuda::bf16*>(weight.raw()), rstd.data<float>(), rows,
                                           dim));
    return;
  }
  expect_tensor(dx, Device::CPU, DType::F32, "rmsnorm_backward dx");
  expect_tensor(dweight, Device::CPU, DType::F32, "rmsnorm_backward dweight");
  expect_tensor(dy, Device::CPU, DType::F32, "rmsnorm_backward dy");
  expect_tensor(x, Device::CPU, DType::F32, "rmsnorm_backward x");
  expect_tensor(weight, Device::CPU, DType::F32, "rmsnorm_backward weight");
  expect_tensor(rstd, Device::CPU, DType::F32, "rmsnorm_backward rstd");
  cpu::rmsnorm_backward(dx.data<float>(), dweight.data<float>(), dy.data<float>(), x.data<float>(),
                        weight.data<float>(), rstd.data<float>(), rows, dim);
}

}  // namespace forge
