#include "ops/random_normal.h"

#include <limits>

#include "core/op_profile.h"
#include "kernels/cpu/random_normal.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/random_normal.h"
#endif

namespace forge {

void random_normal(const Tensor& out, uint64_t seed, uint64_t offset) {
  OpProfileScope profile(OpClass::Elementwise, "random_normal");
  const int64_t n = out.numel();
  FORGE_CHECK(static_cast<uint64_t>(n) <= std::numeric_limits<uint64_t>::max() - offset,
              "random_normal: {} numbers from offset {} pass the end of the stream (2^64 numbers)", n, offset);
  if (out.device() == Device::CUDA) {
    FORGE_CHECK(out.dtype() == DType::F32 || out.dtype() == DType::BF16,
                "random_normal: out holds {}, expected f32 or bf16 on CUDA", dtype_name(out.dtype()));
    if (out.dtype() == DType::F32) {
      FORGE_CUDA_CALL("random_normal", cuda::random_normal(out.data<float>(), n, seed, offset));
    } else {
      FORGE_CUDA_CALL("random_normal", cuda::random_normal(bf16_ptr(out), n, seed, offset));
    }
    return;
  }
  expect_tensor(out, Device::CPU, DType::F32, "random_normal out");
  cpu::random_normal(out.data<float>(), n, seed, offset);
}

}  // namespace forge
