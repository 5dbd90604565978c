#include "ops/swiglu.h"

#include "kernels/cpu/swiglu.h"
#include "core/op_profile.h"
#include "ops/linear.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/swiglu.h"
#endif

namespace forge {
void swiglu_forward(const Tensor& out, const Tensor& gate_up, const LinearWeight* feeds) {
  OpProfileScope profile(OpClass::Elementwise, "swiglu_forward");
  FORGE_CHECK(gate_up.ndim() == 2 && gate_up.dim(1) % 2 == 0, "swiglu_forward: gate_up {} must be [N, 2F]",
              shape_str(gate_up.shape()));
  int64_t rows = gate_up.dim(0), ffn = gate_up.dim(1) / 2;
  check_shape(out, {rows, ffn}, "swiglu_forward out");
  if (gate_up.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "swiglu_forward out");
    expect_tensor(gate_up, Device::CUDA, DType::BF16, "swiglu_forward gate_up");
    const cuda::Fp8Epilogue fp8 = fp8_input_epilogue(out, feeds ? feeds->fp8 : nullptr);
    FORGE_CUDA_CALL("swiglu_forward",
                    cuda::swiglu_forward(static_cast<cuda::bf16*>(out.raw()),
                                         static_cast<const cuda::bf16*>(gate_up.raw()), rows, ffn, fp8));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "swiglu_forward out");
  expect_tensor(gate_up, Device::CPU, DType::F32, "swiglu_forward gate_up");
  cpu::swiglu_forward(out.data<float>(), gate_up.data<float>(), rows, ffn);
}

void swiglu_backward(const Tensor& dgate_up, const Tensor& dout, const Tensor& gate_up,
                     const LinearWeight* feeds) {
  OpProfileScope profile(OpClass::Elementwise, "swiglu_backward");
  FORGE_CHECK(gate_up.ndim() == 2 && gate_up.dim(1) % 2 == 0, "swiglu_backward: gate_up {} must be [N, 2F]",
              shape_str(gate_up.shape()));
  int64_t rows = gate_up.dim(0), ffn = gate_up.dim(1) / 2;
  check_shape(dgate_up, gate_up.shape(), "swiglu_backward dgate_up");
  check_shape(dout, {rows, ffn}, "swiglu_backward dout");
  if (gate_up.device() == Device::CUDA) {
    expect_tensor(dgate_up, Device::CUDA, DType::BF16, "swiglu_backward dgate_up");
    expect_tensor(dout, Device::CUDA, DType::BF16, "swiglu_backward dout");
    expect_tensor(gate_up, Device::CUDA, DType::BF16, "swiglu_backward gate_up");
    float* amax = fp8_output_gradient_amax(dgate_up, feeds ? feeds->fp8 : nullptr);
    FORGE_CUDA_CALL("swiglu_backward",
                    cuda::swiglu_backward(static_cast<cuda::bf16*>(dgate_up.raw()),
                                          static_cast<const cuda::bf16*>(dout.raw()),
                                          static_cast<const cuda::bf16*>(gate_up.raw()), rows, ffn, amax));
    return;
  }
  expect_tensor(dgate_up, Device::CPU, DType::F32, "swiglu_backward dgate_up");
  expect_tensor(dout, Device::CPU, DType::F32, "swiglu_backward dout");
  expect_tensor(gate_up, Device::CPU, DType::F32, "swiglu_backward gate_up");
  cpu::swiglu_backward(dgate_up.data<float>(), dout.data<float>(), gate_up.data<float>(), rows, ffn);
}

}  // namespace forge
