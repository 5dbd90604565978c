// The pixel autoencoder (NOTE [Pixel latents]): the documented fold, its exact inverse, refusals.
#include <gtest/gtest.h>

#include "core/error.h"
#include "core/rng.h"
#include "model/pixel_latents.h"

namespace forge {
namespace {

Tensor random_image(int64_t b, int64_t h, int64_t w, uint64_t seed) {
  Tensor image = Tensor::empty({b, 3, h, w});
  Rng rng(seed);
  for (int64_t i = 0; i < image.numel(); ++i) image.data<float>()[i] = static_cast<float>(rng.uniform() * 2 - 1);
  return image;
}

TEST(PixelLatents, FoldsEach2x2BlockIntoSixteenChannels) {
  const Tensor image = random_image(2, 6, 4, 3);
  Tensor latents = Tensor::empty({2, 16, 3, 2});
  pixel_latents_encode(latents, image);
  auto px = [&](int64_t b, int64_t c, int64_t y, int64_t x) { return image.data<float>()[((b * 3 + c) * 6 + y) * 4 + x]; };
  auto lt = [&](int64_t b, int64_t c, int64_t y, int64_t x) {
    return latents.data<float>()[((b * 16 + c) * 3 + y) * 2 + x];
  };
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t y = 0; y < 3; ++y)
      for (int64_t x = 0; x < 2; ++x)
        for (int64_t dy = 0; dy < 2; ++dy)
          for (int64_t dx = 0; dx < 2; ++dx) {
            for (int64_t c = 0; c < 3; ++c)
              EXPECT_EQ(lt(b, (dy * 2 + dx) * 4 + c, y, x), px(b, c, 2 * y + dy, 2 * x + dx));
            EXPECT_EQ(lt(b, (dy * 2 + dx) * 4 + 3, y, x), 0.0f);
          }
}

TEST(PixelLatents, DecodeInvertsEncodeExactly) {
  const Tensor image = random_image(3, 8, 10, 7);
  Tensor latents = Tensor::empty({3, 16, 4, 5});
  Tensor back = Tensor::empty({3, 3, 8, 10});
  pixel_latents_encode(latents, image);
  pixel_latents_decode(back, latents);
  for (int64_t i = 0; i < image.numel(); ++i) ASSERT_EQ(back.data<float>()[i], image.data<float>()[i]) << i;
}

TEST(PixelLatents, RefusesOddSidesAndMismatchedShapes) {
  Tensor latents = Tensor::empty({1, 16, 2, 2});
  EXPECT_THROW(pixel_latents_encode(latents, random_image(1, 5, 4, 1)), Error);
  EXPECT_THROW(pixel_latents_encode(latents, random_image(1, 6, 4, 1)), Error);
  EXPECT_THROW(pixel_latents_decode(Tensor::empty({1, 4, 4, 4}), latents), Error);
}

}  // namespace
}  // namespace forge
