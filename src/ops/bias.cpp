#include "ops/bias.h"

#include "core/op_profile.h"
#include "kernels/cpu/bias.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/bias.h"
#endif

namespace forge {

void add_bias(const Tensor& y, const Tensor& bias) {
  OpProfileScope profile(OpClass::Elementwise, "add_bias");
  FORGE_CHECK(y.ndim() == 2, "add_bias: y {} must be [N, F]", shape_str(y.shape()));
  const int64_t rows = y.dim(0), features = y.dim(1);
  check_shape(bias, {features}, "add_bias bias");
  if (y.device() == Device::CUDA) {
    expect_tensor(y, Device::CUDA, DType::BF16, "add_bias y");
    expect_tensor(bias, Device::CUDA, DType::BF16, "add_bias bias");
    FORGE_CUDA_CALL("add_bias", cuda::add_bias(bf16_ptr(y), bf16_ptr(bias), rows, features));
    return;
  }
  expect_tensor(y, Device::CPU, DType::F32, "add_bias y");
  expect_tensor(bias, Device::CPU, DType::F32, "add_bias bias");
  cpu::add_bias(y.data<float>(), bias.data<float>(), rows, features);
}

void bias_gradient(const Tensor& grad_bias, const Tensor& dy, bool overwrite) {
  OpProfileScope profile(OpClass::Elementwise, "bias_gradient");
  FORGE_CHECK(dy.ndim() == 2, "bias_gradient: dy {} must be [N, F]", shape_str(dy.shape()));
  const int64_t rows = dy.dim(0), features = dy.dim(1);
  check_shape(grad_bias, {features}, "bias_gradient grad_bias");
  expect_tensor(grad_bias, dy.device(), DType::F32, "bias_gradient grad_bias");
  if (dy.device() == Device::CUDA) {
    expect_tensor(dy, Device::CUDA, DType::BF16, "bias_gradient dy");
    FORGE_CUDA_CALL("bias_gradient",
                    cuda::bias_gradient(grad_bias.data<float>(), bf16_ptr(dy), rows, features, overwrite));
    return;
  }
  expect_tensor(dy, Device::CPU, DType::F32, "bias_gradient dy");
  cpu::bias_gradient(grad_bias.data<float>(), dy.data<float>(), rows, features, overwrite);
}

}  // namespace forge
