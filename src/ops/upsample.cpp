#include "ops/upsample.h"

#include "core/op_profile.h"
#include "kernels/cpu/upsample.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/upsample.h"
#endif

namespace forge {

void upsample_nearest2x(const Tensor& out, const Tensor& in) {
  OpProfileScope profile(OpClass::Elementwise, "upsample_nearest2x");
  FORGE_CHECK(in.ndim() == 4, "upsample_nearest2x: in {} must be [B, H, W, C]", shape_str(in.shape()));
  const int64_t batch = in.dim(0), height = in.dim(1), width = in.dim(2), channels = in.dim(3);
  check_shape(out, {batch, 2 * height, 2 * width, channels}, "upsample_nearest2x out");
  if (in.device() == Device::CUDA) {
    expect_tensor(out, Device::CUDA, DType::BF16, "upsample_nearest2x out");
    expect_tensor(in, Device::CUDA, DType::BF16, "upsample_nearest2x in");
    FORGE_CUDA_CALL("upsample_nearest2x",
                    cuda::upsample_nearest2x(bf16_ptr(out), bf16_ptr(in), batch, height, width, channels));
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "upsample_nearest2x out");
  expect_tensor(in, Device::CPU, DType::F32, "upsample_nearest2x in");
  cpu::upsample_nearest2x(out.data<float>(), in.data<float>(), batch, height, width, channels);
}

}  // namespace forge
