#include "ops/gated_residual.h"

#include "core/op_profile.h"
#include "kernels/cpu/gated_residual.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/gated_residual.h"
#endif

namespace forge {

void gated_residual_forward(const Tensor& x, const Tensor& y, const Tensor& gate) {
  gated_residual_forward(x, x, y, gate);
}

void gated_residual_forward(const Tensor& out, const Tensor& x, const Tensor& y, const Tensor& gate) {
  OpProfileScope profile(OpClass::Elementwise, "gated_residual_forward");
  FORGE_CHECK(x.ndim() == 3, "gated_residual_forward: x {} must be [B, T, D]", shape_str(x.shape()));
  const int64_t batch = x.dim(0), tokens = x.dim(1), dim = x.dim(2);
  check_shape(out, x.shape(), "gated_residual_forward out");
  check_shape(y, x.shape(), "gated_residual_forward y");
  check_shape(gate, {batch, dim}, "gated_residual_forward gate");
  FORGE_CHECK(out.raw() != y.raw() && out.raw() != gate.raw(),
              "gated_residual_forward: out must not alias y or gate (only x, for the add in place)");
  if (x.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "gated_residual_forward out");
    expect_tensor(x, Device::CUDA, DType::BF16, "gated_residual_forward x");
    expect_tensor(y, Device::CUDA, DType::BF16, "gated_residual_forward y");
    expect_tensor(gate, Device::CUDA, DType::BF16, "gated_residual_forward gate");
    FORGE_CUDA_CALL("gated_residual_forward", cuda::gated_residual_forward(bf16_ptr(out), bf16_ptr(x), bf16_ptr(y),
                                                                           bf16_ptr(gate), batch, tokens, dim));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "gated_residual_forward out");
  expect_tensor(x, Device::CPU, DType::F32, "gated_residual_forward x");
  expect_tensor(y, Device::CPU, DType::F32, "gated_residual_forward y");
  expect_tensor(gate, Device::CPU, DType::F32, "gated_residual_forward gate");
  cpu::gated_residual_forward(out.data<float>(), x.data<float>(), y.data<float>(), gate.data<float>(), batch, tokens,
                              dim);
}

void gated_residual_backward(const Tensor& dy, const Tensor& dgate, const Tensor& dx, const Tensor& y,
                             const Tensor& gate) {
  OpProfileScope profile(OpClass::Elementwise, "gated_residual_backward");
  FORGE_CHECK(dx.ndim() == 3, "gated_residual_backward: dx {} must be [B, T, D]", shape_str(dx.shape()));
  const int64_t batch = dx.dim(0), tokens = dx.dim(1), dim = dx.dim(2);
  check_shape(dy, dx.shape(), "gated_residual_backward dy");
  check_shape(y, dx.shape(), "gated_residual_backward y");
  check_shape(dgate, {batch, dim}, "gated_residual_backward dgate");
  check_shape(gate, {batch, dim}, "gated_residual_backward gate");
  if (dx.device() == Device::CUDA) {
    expect_tensor(dy, Device::CUDA, DType::BF16, "gated_residual_backward dy");
    expect_tensor(dgate, Device::CUDA, DType::BF16, "gated_residual_backward dgate");
    expect_tensor(dx, Device::CUDA, DType::BF16, "gated_residual_backward dx");
    expect_tensor(y, Device::CUDA, DType::BF16, "gated_residual_backward y");
    expect_tensor(gate, Device::CUDA, DType::BF16, "gated_residual_backward gate");
    FORGE_CUDA_CALL("gated_residual_backward",
                    cuda::gated_residual_backward(bf16_ptr(dy), bf16_ptr(dgate), bf16_ptr(dx), bf16_ptr(y),
                                                  bf16_ptr(gate), batch, tokens, dim));
    return;
  }
  expect_tensor(dy, Device::CPU, DType::F32, "gated_residual_backward dy");
  expect_tensor(dgate, Device::CPU, DType::F32, "gated_residual_backward dgate");
  expect_tensor(dx, Device::CPU, DType::F32, "gated_residual_backward dx");
  expect_tensor(y, Device::CPU, DType::F32, "gated_residual_backward y");
  expect_tensor(gate, Device::CPU, DType::F32, "gated_residual_backward gate");
  cpu::gated_residual_backward(dy.data<float>(), dgate.data<float>(), dx.data<float>(), y.data<float>(),
                               gate.data<float>(), batch, tokens, dim);
}

}  // namespace forge
