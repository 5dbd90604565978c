// copy_converted and converted (ops/convert.h) between the host and the GPU, against the
// CPU's cast on fresh random data: fp32 host values into bf16 (and fp32) GPU tensors and
// back, bitwise, over sizes with and without a tail of a whole vector.
#include <gtest/gtest.h>

#include "gpu_testing.h"
#include "ops/convert.h"

namespace forge::gpu_test {
namespace {

TEST(GpuConvertedCopy, HostAndGpuBothWaysMatchTheCpuCast) {
  Rng rng(seed_for_current_test());
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{4096}, int64_t{100003}}) {
    const Tensor host = random_f32({n}, rng, 3.0);
    const Tensor want = Tensor::empty({n}, DType::BF16);
    cast(want, host);
    const Tensor gpu = poisoned_gpu({n}, DType::BF16);
    copy_converted(gpu, host);
    EXPECT_EQ(host_values<uint16_t>(gpu), host_values<uint16_t>(want)) << n;
    const Tensor back = Tensor::empty({n});
    copy_converted(back, gpu);
    const Tensor want_back = Tensor::empty({n});
    cast(want_back, want);
    EXPECT_EQ(host_values<float>(back), host_values<float>(want_back)) << n;
    const Tensor wide = converted(host, Device::CUDA, DType::F32);
    EXPECT_EQ(wide.device(), Device::CUDA);
    EXPECT_EQ(host_values<float>(wide), host_values<float>(host)) << n;
    const Tensor narrow = converted(host, Device::CUDA, DType::BF16);
    EXPECT_EQ(host_values<uint16_t>(narrow), host_values<uint16_t>(want)) << n;
  }
}

}  // namespace
}  // namespace forge::gpu_test
