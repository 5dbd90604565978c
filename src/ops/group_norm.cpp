#include "ops/group_norm.h"

#include "core/op_profile.h"
#include "kernels/cpu/group_norm.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/group_norm.h"
#endif

namespace forge {

void group_norm_forward(const Tensor& out, const Tensor& in, const Tensor& weight, const Tensor& bias,
                        const GroupNormShape& shape) {
  OpProfileScope profile(OpClass::Elementwise, "group_norm_forward");
  FORGE_CHECK(in.ndim() >= 2, "group_norm_forward: in {} must be [B, ..., C]", shape_str(in.shape()));
  check_shape(out, in.shape(), "group_norm_forward out");
  const int64_t batch = in.dim(0), channels = in.dim(-1);
  const int64_t pixels = batch > 0 && channels > 0 ? in.numel() / (batch * channels) : 0;
  FORGE_CHECK(shape.groups > 0 && channels % shape.groups == 0,
              "group_norm_forward: {} channels do not split into {} groups", channels, shape.groups);
  FORGE_CHECK(shape.eps > 0.0f, "group_norm_forward: eps {} must be positive", shape.eps);
  check_shape(weight, {channels}, "group_norm_forward weight");
  check_shape(bias, {channels}, "group_norm_forward bias");
  if (in.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "group_norm_forward out");
    expect_tensor(in, Device::CUDA, DType::BF16, "group_norm_forward in");
    expect_tensor(weight, Device::CUDA, DType::BF16, "group_norm_forward weight");
    expect_tensor(bias, Device::CUDA, DType::BF16, "group_norm_forward bias");
    FORGE_CUDA_CALL("group_norm_forward",
                    cuda::group_norm_forward(bf16_ptr(out), bf16_ptr(in), bf16_ptr(weight), bf16_ptr(bias), batch,
                                             pixels, channels, shape.groups, shape.eps, shape.silu));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "group_norm_forward out");
  expect_tensor(in, Device::CPU, DType::F32, "group_norm_forward in");
  expect_tensor(weight, Device::CPU, DType::F32, "group_norm_forward weight");
  expect_tensor(bias, Device::CPU, DType::F32, "group_norm_forward bias");
  cpu::group_norm_forward(out.data<float>(), in.data<float>(), weight.data<float>(), bias.data<float>(), batch, pixels,
                          channels, shape.groups, shape.eps, shape.silu);
}

}  // namespace forge
