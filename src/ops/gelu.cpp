#include "ops/gelu.h"

#include <string>

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

namespace {

// Checks a forward-only member of the family (out = f(in) elementwise, ops/gelu.h) and says
// where it runs.
Device unary_forward_device(const Tensor& out, const Tensor& in, const char* op) {
  const std::string out_name = std::string(op) + " out", in_name = std::string(op) + " in";
  FORGE_CHECK(out.numel() == in.numel(), "{}: out {} and in {} must hold as many elements", op, shape_str(out.shape()),
              shape_str(in.shape()));
  const DType dtype = in.device() == Device::CUDA ? DType::BF16 : DType::F32;
  expect_tensor(out, in.device(), dtype, out_name.c_str());
  expect_tensor(in, in.device(), dtype, in_name.c_str());
  return in.device();
}

}  // namespace

void gelu_erf_forward(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "gelu_erf_forward");
  if (unary_forward_device(out, in, "gelu_erf_forward") == Device::CUDA) {
    FORGE_CUDA_CALL("gelu_erf_forward", cuda::gelu_erf_forward(bf16_ptr(out), bf16_ptr(in), in.numel()));
    return;
  }
  cpu::gelu_erf_forward(out.data<float>(), in.data<float>(), in.numel());
}

void quick_gelu_forward(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "quick_gelu_forward");
  if (unary_forward_device(out, in, "quick_gelu_forward") == Device::CUDA) {
    FORGE_CUDA_CALL("quick_gelu_forward", cuda::quick_gelu_forward(bf16_ptr(out), bf16_ptr(in), in.numel()));
    return;
  }
  cpu::quick_gelu_forward(out.data<float>(), in.data<float>(), in.numel());
}

}  // namespace forge
