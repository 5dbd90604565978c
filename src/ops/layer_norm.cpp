#include "ops/layer_norm.h"

#include "core/op_profile.h"
#include "kernels/cpu/layer_norm.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/layer_norm.h"
#endif

namespace forge {

void layer_norm_forward(const Tensor& y, const Tensor& x, const Tensor& weight, const Tensor& bias, float eps) {
  OpProfileScope profile(OpClass::Elementwise, "layer_norm_forward");
  FORGE_CHECK(x.ndim() >= 1, "layer_norm_forward: x must have at least one dim");
  const int64_t dim = x.dim(-1);
  FORGE_CHECK(dim > 0, "layer_norm_forward: x {} has an empty last dim", shape_str(x.shape()));
  FORGE_CHECK(eps >= 0.0f, "layer_norm_forward: eps {} must be >= 0", eps);
  const int64_t rows = x.numel() / dim;
  check_shape(y, x.shape(), "layer_norm_forward y");
  check_shape(weight, {dim}, "layer_norm_forward weight");
  check_shape(bias, {dim}, "layer_norm_forward bias");
  if (x.device() == Device::CUDA) {
    expect_tensor(y, Device::CUDA, DType::BF16, "layer_norm_forward y");
    expect_tensor(x, Device::CUDA, DType::BF16, "layer_norm_forward x");
    expect_tensor(weight, Device::CUDA, DType::BF16, "layer_norm_forward weight");
    expect_tensor(bias, Device::CUDA, DType::BF16, "layer_norm_forward bias");
    FORGE_CUDA_CALL("layer_norm_forward", cuda::layer_norm_forward(bf16_ptr(y), bf16_ptr(x), bf16_ptr(weight),
                                                                   bf16_ptr(bias), rows, dim, eps));
    return;
  }
  expect_tensor(y, Device::CPU, DType::F32, "layer_norm_forward y");
  expect_tensor(x, Device::CPU, DType::F32, "layer_norm_forward x");
  expect_tensor(weight, Device::CPU, DType::F32, "layer_norm_forward weight");
  expect_tensor(bias, Device::CPU, DType::F32, "layer_norm_forward bias");
  cpu::layer_norm_forward(y.data<float>(), x.data<float>(), weight.data<float>(), bias.data<float>(), rows, dim, eps);
}

}  // namespace forge
