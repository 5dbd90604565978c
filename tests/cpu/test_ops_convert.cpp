// copy_converted and converted (ops/convert.h) on the CPU: fp32 <-> bf16 as cast() rounds,
// a plain copy for equal dtypes, any shapes of the same element count, and `converted`
// handing back its argument when nothing is to convert. tests/gpu/test_gpu_convert.cpp
// covers the host <-> GPU directions.
#include <gtest/gtest.h>

#include "core/bf16.h"
#include "expect_error.h"
#include "ops/convert.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;

TEST(ConvertedCopy, Fp32ToBf16AndBackOnTheCpu) {
  Rng rng(71);
  const Tensor wide = random_tensor({3, 5, 7}, rng, 4.0);
  const Tensor narrow = Tensor::empty({105}, DType::BF16);
  copy_converted(narrow, wide);
  for (int64_t i = 0; i < 105; ++i)
    EXPECT_EQ(narrow.data<BFloat16>()[i].bits, to_bf16(wide.data<float>()[i]).bits) << i;
  const Tensor back = Tensor::empty({3, 35});
  copy_converted(back, narrow);
  for (int64_t i = 0; i < 105; ++i) EXPECT_EQ(back.data<float>()[i], to_float(narrow.data<BFloat16>()[i])) << i;
  const Tensor same = Tensor::empty({105});
  copy_converted(same, wide);
  for (int64_t i = 0; i < 105; ++i) EXPECT_EQ(same.data<float>()[i], wide.data<float>()[i]) << i;
}

TEST(ConvertedCopy, ConvertedKeepsATensorAlreadyInPlace) {
  Rng rng(72);
  const Tensor wide = random_tensor({4, 6}, rng);
  EXPECT_EQ(converted(wide, Device::CPU, DType::F32).raw(), wide.raw());
  const Tensor narrow = converted(wide, Device::CPU, DType::BF16);
  ASSERT_EQ(narrow.dtype(), DType::BF16);
  ASSERT_EQ(narrow.shape(), wide.shape());
  for (int64_t i = 0; i < wide.numel(); ++i)
    EXPECT_EQ(narrow.data<BFloat16>()[i].bits, to_bf16(wide.data<float>()[i]).bits) << i;
}

TEST(ConvertedCopy, RefusesOtherElementCounts) {
  expect_error([] { copy_converted(Tensor::empty({4}), Tensor::empty({5}, DType::BF16)); }, {"copy_converted"});
}

}  // namespace
}  // namespace forge
