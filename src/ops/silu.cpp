#include "ops/silu.h"

#include "core/op_profile.h"
#include "kernels/cpu/silu.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/silu.h"
#endif

namespace forge {

void silu_forward(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "silu_forward");
  FORGE_CHECK(out.numel() == in.numel(), "silu_forward: out {} and in {} must hold as many elements",
              shape_str(out.shape()), shape_str(in.shape()));
  if (in.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "silu_forward out");
    expect_tensor(in, Device::CUDA, DType::BF16, "silu_forward in");
    FORGE_CUDA_CALL("silu_forward", cuda::silu_forward(bf16_ptr(out), bf16_ptr(in), in.numel()));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "silu_forward out");
  expect_tensor(in, Device::CPU, DType::F32, "silu_forward in");
  cpu::silu_forward(out.data<float>(), in.data<float>(), in.numel());
}

void silu_backward(const Tensor& din, const Tensor& dout, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "silu_backward");
  FORGE_CHECK(din.numel() == in.numel() && dout.numel() == in.numel(),
              "silu_backward: din {}, dout {} and in {} must hold as many elements", shape_str(din.shape()),
              shape_str(dout.shape()), shape_str(in.shape()));
  if (in.device() == Device::CUDA) {
    expect_tensor(din, Device::CUDA, DType::BF16, "silu_backward din");
    expect_tensor(dout, Device::CUDA, DType::BF16, "silu_backward dout");
    expect_tensor(in, Device::CUDA, DType::BF16, "silu_backward in");
    FORGE_CUDA_CALL("silu_backward",
                    cuda::silu_backward(bf16_ptr(din), bf16_ptr(dout), bf16_ptr(in), in.numel()));
    return;
  }
  expect_tensor(din, Device::CPU, DType::F32, "silu_backward din");
  expect_tensor(dout, Device::CPU, DType::F32, "silu_backward dout");
  expect_tensor(in, Device::CPU, DType::F32, "silu_backward in");
  cpu::silu_backward(din.data<float>(), dout.data<float>(), in.data<float>(), in.numel());
}

}  // namespace forge
