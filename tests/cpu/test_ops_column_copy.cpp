// copy_columns (core/tensor.h): the concatenations and splits along a non-leading axis that
// FLUX's joint attention does (text and image tokens into one sequence and back, and
// feature ranges of a fused projection), checked element by element.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/tensor.h"
#include "expect_error.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;

TEST(OpsColumnCopy, CopiesTheBlockAndNothingElse) {
  Rng rng(101);
  const Tensor src = random_tensor({5, 11}, rng), dst = random_tensor({5, 9}, rng);
  const Tensor before = dst.clone();
  copy_columns(dst, 2, src, 4, 6);
  for (int64_t r = 0; r < 5; ++r)
    for (int64_t c = 0; c < 9; ++c) {
      const float want = c >= 2 && c < 8 ? src.data<float>()[r * 11 + 4 + c - 2] : before.data<float>()[r * 9 + c];
      ASSERT_EQ(dst.data<float>()[r * 9 + c], want) << "row " << r << " column " << c;
    }
  copy_columns(dst, 0, src, 0, 0);  // an empty block changes nothing
  copy_columns(dst, 9, src, 11, 0);
  EXPECT_EQ(dst.data<float>()[0], before.data<float>()[0]);
}

// [B, Tt, F] and [B, Ti, F] into the joint [B, Tt + Ti, F] (viewed [B, T F], the sequence
// ranges are column ranges) and split back: the same bits.
TEST(OpsColumnCopy, JoinsAndSplitsSequencesExactly) {
  Rng rng(102);
  const int64_t batch = 3, text = 4, image = 7, features = 5;
  const Tensor txt = random_tensor({batch, text, features}, rng), img = random_tensor({batch, image, features}, rng);
  Tensor joint = Tensor::empty({batch, text + image, features});
  testing::fill_nan(joint);
  const Tensor joint_rows = joint.view({batch, (text + image) * features});
  copy_columns(joint_rows, 0, txt.view({batch, text * features}), 0, text * features);
  copy_columns(joint_rows, text * features, img.view({batch, image * features}), 0, image * features);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < text + image; ++t)
      for (int64_t f = 0; f < features; ++f) {
        const float want = t < text ? txt.data<float>()[(b * text + t) * features + f]
                                    : img.data<float>()[(b * image + t - text) * features + f];
        ASSERT_EQ(joint.data<float>()[(b * (text + image) + t) * features + f], want);
      }
  Tensor txt_back = Tensor::empty(txt.shape()), img_back = Tensor::empty(img.shape());
  copy_columns(txt_back.view({batch, text * features}), 0, joint_rows, 0, text * features);
  copy_columns(img_back.view({batch, image * features}), 0, joint_rows, text * features, image * features);
  EXPECT_TRUE(testing::bitwise_equal(txt_back, txt));
  EXPECT_TRUE(testing::bitwise_equal(img_back, img));
}

// Any dtype: the copy moves bytes (bf16 and int32 here).
TEST(OpsColumnCopy, CopiesOtherDtypes) {
  for (DType dtype : {DType::BF16, DType::I32}) {
    Tensor src = Tensor::empty({3, 6}, dtype), dst = Tensor::zeros({3, 4}, dtype);
    const size_t element = dtype_size(dtype);
    for (size_t i = 0; i < src.nbytes(); ++i) static_cast<uint8_t*>(src.raw())[i] = static_cast<uint8_t>(i + 1);
    copy_columns(dst, 1, src, 3, 2);
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t c = 0; c < 4; ++c)
        for (size_t k = 0; k < element; ++k) {
          const uint8_t got = static_cast<const uint8_t*>(dst.raw())[(r * 4 + c) * element + k];
          const uint8_t want = c >= 1 && c < 3 ? static_cast<uint8_t>((r * 6 + 3 + c - 1) * element + k + 1) : 0;
          ASSERT_EQ(got, want) << dtype_name(dtype) << " row " << r << " column " << c;
        }
  }
}

TEST(OpsColumnCopy, BadBlocksAreClearErrors) {
  const Tensor src = Tensor::zeros({4, 6}), dst = Tensor::zeros({4, 5});
  expect_error([&] { copy_columns(dst, 0, Tensor::zeros({3, 6}), 0, 2); }, {"copy_columns", "the same rows"});
  expect_error([&] { copy_columns(dst, 0, Tensor::zeros({4, 6}, DType::I32), 0, 2); }, {"copy_columns", "dtype"});
  expect_error([&] { copy_columns(dst, 0, Tensor::zeros({4, 2, 3}), 0, 2); }, {"copy_columns", "2-D"});
  expect_error([&] { copy_columns(dst, 4, src, 0, 2); }, {"copy_columns", "[4, 6) of [4, 5]"});
  expect_error([&] { copy_columns(dst, 0, src, 5, 2); }, {"copy_columns", "[5, 7) of [4, 6]"});
  expect_error([&] { copy_columns(dst, 0, src, -1, 2); }, {"copy_columns"});
}

}  // namespace
}  // namespace forge
