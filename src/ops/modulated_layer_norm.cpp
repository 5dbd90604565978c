#include "ops/modulated_layer_norm.h"

#include "core/op_profile.h"
#include "kernels/cpu/modulated_layer_norm.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/modulated_layer_norm.h"
#endif

namespace forge {

void modulated_layer_norm_forward(const Tensor& y, const Tensor& mean, const Tensor& rstd, const Tensor& x,
                                  const Tensor& shift, const Tensor& scale, float eps) {
  OpProfileScope profile(OpClass::Elementwise, "modulated_layer_norm_forward");
  FORGE_CHECK(x.ndim() == 3, "modulated_layer_norm_forward: x {} must be [B, T, D]", shape_str(x.shape()));
  const int64_t batch = x.dim(0), tokens = x.dim(1), dim = x.dim(2);
  check_shape(y, x.shape(), "modulated_layer_norm_forward y");
  check_shape(mean, {batch, tokens}, "modulated_layer_norm_forward mean");
  check_shape(rstd, {batch, tokens}, "modulated_layer_norm_forward rstd");
  check_shape(shift, {batch, dim}, "modulated_layer_norm_forward shift");
  check_shape(scale, {batch, dim}, "modulated_layer_norm_forward scale");
  if (x.device() == Device::CUDA) {
    expect_tensor(y, Device::CUDA, DType::BF16, "modulated_layer_norm_forward y");
    expect_tensor(mean, Device::CUDA, DType::F32, "modulated_layer_norm_forward mean");
    expect_tensor(rstd, Device::CUDA, DType::F32, "modulated_layer_norm_forward rstd");
    expect_tensor(x, Device::CUDA, DType::BF16, "modulated_layer_norm_forward x");
    expect_tensor(shift, Device::CUDA, DType::BF16, "modulated_layer_norm_forward shift");
    expect_tensor(scale, Device::CUDA, DType::BF16, "modulated_layer_norm_forward scale");
    FORGE_CUDA_CALL("modulated_layer_norm_forward",
                    cuda::modulated_layer_norm_forward(bf16_ptr(y), mean.data<float>(), rstd.data<float>(),
                                                       bf16_ptr(x), bf16_ptr(shift), bf16_ptr(scale), batch,
                                                       tokens, dim, eps));
    return;
  }
  expect_tensor(y, Device::CPU, DType::F32, "modulated_layer_norm_forward y");
  expect_tensor(mean, Device::CPU, DType::F32, "modulated_layer_norm_forward mean");
  expect_tensor(rstd, Device::CPU, DType::F32, "modulated_layer_norm_forward rstd");
  expect_tensor(x, Device::CPU, DType::F32, "modulated_layer_norm_forward x");
  expect_tensor(shift, Device::CPU, DType::F32, "modulated_layer_norm_forward shift");
  expect_tensor(scale, Device::CPU, DType::F32, "modulated_layer_norm_forward scale");
  cpu::modulated_layer_norm_forward(y.data<float>(), mean.data<float>(), rstd.data<float>(), x.data<float>(),
                                    shift.data<float>(), scale.data<float>(), batch, tokens, dim, eps);
}

void modulated_layer_norm_backward(const Tensor& dx, const Tensor& dshift, const Tensor& dscale, const Tensor& dy,
                                   const Tensor& x, const Tensor& scale, const Tensor& mean, const Tensor& rstd) {
  OpProfileScope profile(OpClass::Elementwise, "modulated_layer_norm_backward");
  FORGE_CHECK(x.ndim() == 3, "modulated_layer_norm_backward: x {} must be [B, T, D]", shape_str(x.shape()));
  const int64_t batch = x.dim(0), tokens = x.dim(1), dim = x.dim(2);
  check_shape(dx, x.shape(), "modulated_layer_norm_backward dx");
  check_shape(dy, x.shape(), "modulated_layer_norm_backward dy");
  check_shape(dshift, {batch, dim}, "modulated_layer_norm_backward dshift");
  check_shape(dscale, {batch, dim}, "modulated_layer_norm_backward dscale");
  check_shape(scale, {batch, dim}, "modulated_layer_norm_backward scale");
  check_shape(mean, {batch, tokens}, "modulated_layer_norm_backward mean");
  check_shape(rstd, {batch, tokens}, "modulated_layer_norm_backward rstd");
  if (x.device() == Device::CUDA) {
    expect_tensor(dx, Device::CUDA, DType::BF16, "modulated_layer_norm_backward dx");
    expect_tensor(dshift, Device::CUDA, DType::BF16, "modulated_layer_norm_backward dshift");
    expect_tensor(dscale, Device::CUDA, DType::BF16, "modulated_layer_norm_backward dscale");
    expect_tensor(dy, Device::CUDA, DType::BF16, "modulated_layer_norm_backward dy");
    expect_tensor(x, Device::CUDA, DType::BF16, "modulated_layer_norm_backward x");
    expect_tensor(scale, Device::CUDA, DType::BF16, "modulated_layer_norm_backward scale");
    expect_tensor(mean, Device::CUDA, DType::F32, "modulated_layer_norm_backward mean");
    expect_tensor(rstd, Device::CUDA, DType::F32, "modulated_layer_norm_backward rstd");
    FORGE_CUDA_CALL("modulated_layer_norm_backward",
                    cuda::modulated_layer_norm_backward(bf16_ptr(dx), bf16_ptr(dshift), bf16_ptr(dscale),
                                                        bf16_ptr(dy), bf16_ptr(x), bf16_ptr(scale),
                                                        mean.data<float>(), rstd.data<float>(), batch, tokens,
                                                        dim));
    return;
  }
  expect_tensor(dx, Device::CPU, DType::F32, "modulated_layer_norm_backward dx");
  expect_tensor(dshift, Device::CPU, DType::F32, "modulated_layer_norm_backward dshift");
  expect_tensor(dscale, Device::CPU, DType::F32, "modulated_layer_norm_backward dscale");
  expect_tensor(dy, Device::CPU, DType::F32, "modulated_layer_norm_backward dy");
  expect_tensor(x, Device::CPU, DType::F32, "modulated_layer_norm_backward x");
  expect_tensor(scale, Device::CPU, DType::F32, "modulated_layer_norm_backward scale");
  expect_tensor(mean, Device::CPU, DType::F32, "modulated_layer_norm_backward mean");
  expect_tensor(rstd, Device::CPU, DType::F32, "modulated_layer_norm_backward rstd");
  cpu::modulated_layer_norm_backward(dx.data<float>(), dshift.data<float>(), dscale.data<float>(), dy.data<float>(),
                                     x.data<float>(), scale.data<float>(), mean.data<float>(), rstd.data<float>(),
                                     batch, tokens, dim);
}

}  // namespace forge
