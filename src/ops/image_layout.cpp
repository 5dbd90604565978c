#include "ops/image_layout.h"

#include "core/op_profile.h"
#include "kernels/cpu/image_layout.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/image_layout.h"
#endif

namespace forge {
namespace {

// One transpose: out and in on the same device in its dtype; `nhwc` is the [B, H, W, C] one.
void transpose(const Tensor& out, const Tensor& in, const Tensor& nhwc, const Tensor& nchw, bool to_nhwc,
               const char* op) {
  FORGE_CHECK(in.ndim() == 4, "{}: in {} must be 4-D", op, shape_str(in.shape()));
  const int64_t batch = nchw.dim(0), channels = nchw.dim(1), pixels = nchw.dim(2) * nchw.dim(3);
  check_shape(nhwc, {batch, nchw.dim(2), nchw.dim(3), channels}, op);
  if (in.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, op);
    expect_tensor(in, Device::CUDA, DType::BF16, op);
    FORGE_CUDA_CALL(op, to_nhwc ? cuda::nhwc_from_nchw(bf16_ptr(out), bf16_ptr(in), batch, channels, pixels)
                                : cuda::nchw_from_nhwc(bf16_ptr(out), bf16_ptr(in), batch, channels, pixels));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, op);
  expect_tensor(in, Device::CPU, DType::F32, op);
  if (to_nhwc)
    cpu::nhwc_from_nchw(out.data<float>(), in.data<float>(), batch, channels, pixels);
  else
    cpu::nchw_from_nhwc(out.data<float>(), in.data<float>(), batch, channels, pixels);
}

}  // namespace

void nhwc_from_nchw(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "nhwc_from_nchw");
  transpose(out, in, out, in, true, "nhwc_from_nchw");
}

void nchw_from_nhwc(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "nchw_from_nhwc");
  FORGE_CHECK(out.ndim() == 4, "nchw_from_nhwc: out {} must be 4-D", shape_str(out.shape()));
  transpose(out, in, in, out, false, "nchw_from_nhwc");
}

}  // namespace forge
