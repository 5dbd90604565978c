#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "expect_error.h"
#include "ops/patchify.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::bitwise_equal;
using testing::random_tensor;

struct LatentShape {
  int64_t batch, channels, height, width, patch;
};

const LatentShape kShapes[] = {{1, 1, 1, 1, 1}, {2, 16, 8, 6, 2}, {1, 3, 9, 6, 3}, {2, 4, 4, 8, 4}, {3, 2, 2, 2, 2}};

Shape tokens_shape(const LatentShape& s) {
  return {s.batch, (s.height / s.patch) * (s.width / s.patch), s.channels * s.patch * s.patch};
}

// diffusers' FluxPipeline._pack_latents, written out as index math for any patch p:
//   latents.view(B, C, H/p, p, W/p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H/p)(W/p), C p p)
// Element (b, c, i, dy, j, dx) of the view is at its row-major offset in the latents; after
// the permutation the same element sits at the row-major offset of (b, i, j, c, dy, dx).
Tensor pack_latents(const Tensor& latents, const LatentShape& s) {
  const int64_t p = s.patch, rows = s.height / p, cols = s.width / p;
  Tensor tokens = Tensor::empty(tokens_shape(s));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t c = 0; c < s.channels; ++c)
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t dy = 0; dy < p; ++dy)
          for (int64_t j = 0; j < cols; ++j)
            for (int64_t dx = 0; dx < p; ++dx) {
              const int64_t view = ((((b * s.channels + c) * rows + i) * p + dy) * cols + j) * p + dx;
              const int64_t permuted = ((((b * rows + i) * cols + j) * s.channels + c) * p + dy) * p + dx;
              tokens.data<float>()[permuted] = latents.data<float>()[view];
            }
  return tokens;
}

TEST(OpsPatchify, MatchesDiffusersPackLatents) {
  Rng rng(71);
  for (const LatentShape& s : kShapes) {
    Tensor latents = random_tensor({s.batch, s.channels, s.height, s.width}, rng);
    Tensor tokens = Tensor::empty(tokens_shape(s));
    testing::fill_nan(tokens);
    patchify(tokens, latents, s.patch);
    EXPECT_TRUE(bitwise_equal(tokens, pack_latents(latents, s))) << s.channels << "x" << s.height << "x" << s.width;
  }
}

TEST(OpsPatchify, UnpatchifyInvertsPatchify) {
  Rng rng(72);
  for (const LatentShape& s : kShapes) {
    Tensor latents = random_tensor({s.batch, s.channels, s.height, s.width}, rng);
    Tensor tokens = Tensor::empty(tokens_shape(s)), back = Tensor::empty(latents.shape());
    testing::fill_nan(back);
    patchify(tokens, latents, s.patch);
    unpatchify(back, tokens, s.patch);
    EXPECT_TRUE(bitwise_equal(back, latents));

    Tensor some_tokens = random_tensor(tokens_shape(s), rng), image = Tensor::empty(latents.shape());
    unpatchify(image, some_tokens, s.patch);
    patchify(tokens, image, s.patch);
    EXPECT_TRUE(bitwise_equal(tokens, some_tokens));
  }
}

// unpatchify is patchify's backward: <patchify(x), y> = <x, unpatchify(y)> for all x, y.
TEST(OpsPatchify, UnpatchifyIsTheAdjoint) {
  Rng rng(73);
  const LatentShape s{2, 16, 8, 6, 2};
  Tensor x = random_tensor({s.batch, s.channels, s.height, s.width}, rng), y = random_tensor(tokens_shape(s), rng);
  Tensor px = Tensor::empty(tokens_shape(s)), uy = Tensor::empty(x.shape());
  patchify(px, x, s.patch);
  unpatchify(uy, y, s.patch);
  EXPECT_NEAR(testing::weighted_sum(px, y), testing::weighted_sum(x, uy), 1e-9);
}

TEST(OpsPatchify, RejectsBadShapesAndDtypes) {
  Tensor latents = Tensor::zeros({1, 16, 8, 6}), tokens = Tensor::zeros({1, 12, 64});
  expect_error([&] { patchify(tokens, Tensor::zeros({1, 16, 7, 6}), 2); }, {"patchify", "multiples of the patch 2"});
  expect_error([&] { patchify(tokens, Tensor::zeros({16, 8, 6}), 2); }, {"patchify", "must be [B, C, H, W]"});
  expect_error([&] { patchify(Tensor::zeros({1, 12, 48}), latents, 2); }, {"patchify tokens"});
  expect_error([&] { unpatchify(latents, Tensor::zeros({1, 24, 64}), 2); }, {"unpatchify tokens"});
  expect_error([&] { patchify(tokens, latents, 0); }, {"patchify", "patch 0"});
  expect_error([&] { patchify(Tensor::zeros({1, 12, 64}, DType::BF16), latents, 2); }, {"patchify tokens", "bf16"});
  patchify(tokens, latents, 2);
}

}  // namespace
}  // namespace forge
