#include "ops/gelu.h"

#include "core/op_profile.h"
#include "kernels/cpu/gelu.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/gelu.h"
#endif

namespace forge {

void gelu_tanh_forward(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "gelu_tanh_forward");
  FORGE_CHECK(out.numel() == in.numel(), "gelu_tanh_forward: out {} and in {} must hold as many elements",
              shape_str(out.shape()), shape_str(in.shape()));
  if (in.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "gelu_tanh_forward out");
    expect_tensor(in, Device::CUDA, DType::BF16, "gelu_tanh_forward in");
    FORGE_CUDA_CALL("gelu_tanh_forward", cuda::gelu_tanh_forward(bf16_ptr(out), bf16_ptr(in), in.numel()));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "gelu_tanh_forward out");
  expect_tensor(in, Device::CPU, DType::F32, "gelu_tanh_forward in");
  cpu::gelu_tanh_forward(out.data<float>(), in.data<float>(), in.numel());
}

void gelu_tanh_backward(const Tensor& din, const Tensor& dout, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "gelu_tanh_backward");
  FORGE_CHECK(din.numel() == in.numel() && dout.numel() == in.numel(),
              "gelu_tanh_backward: din {}, dout {} and in {} must hold as many elements", shape_str(din.shape()),
              shape_str(dout.shape()), shape_str(in.shape()));
  if (in.device() == Device::CUDA) {
    expect_tensor(din, Device::CUDA, DType::BF16, "gelu_tanh_backward din");
    expect_tensor(dout, Device::CUDA, DType::BF16, "gelu_tanh_backward dout");
    expect_tensor(in, Device::CUDA, DType::BF16, "gelu_tanh_backward in");
    FORGE_CUDA_CALL("gelu_tanh_backward",
                    cuda::gelu_tanh_backward(bf16_ptr(din), bf16_ptr(dout), bf16_ptr(in), in.numel()));
    return;
  }
  expect_tensor(din, Device::CPU, DType::F32, "gelu_tanh_backward din");
  expect_tensor(dout, Device::CPU, DType::F32, "gelu_tanh_backward dout");
  expect_tensor(in, Device::CPU, DType::F32, "gelu_tanh_backward in");
  cpu::gelu_tanh_backward(din.data<float>(), dout.data<float>(), in.data<float>(), in.numel());
}

}  // namespace forge
