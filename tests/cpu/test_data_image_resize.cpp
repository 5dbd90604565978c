// Pillow's bilinear resize (data/image_resize.h), resolution buckets (data/image_buckets.h)
// and the FLUX image transform (data/image_transform.h). Byte-for-byte agreement with
// Pillow and torchvision's arithmetic is python.test_image_decode_vs_pil; here: the
// properties and hand-computed values.
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "data/image_buckets.h"
#include "data/image_resize.h"
#include "data/image_transform.h"
#include "expect_error.h"
#include "image_testing.h"

namespace forge {
namespace {

TEST(ImageResize, SameSizeIsTheIdentityAndConstantsStayConstant) {
  const RgbImage image = pattern_image(17, 11);
  EXPECT_EQ(resize_bilinear(image, 17, 11).pixels, image.pixels);
  RgbImage gray(13, 9);
  std::fill(gray.pixels.begin(), gray.pixels.end(), 77);
  for (auto [w, h] : {std::pair{1, 1}, {5, 30}, {40, 3}, {13, 9}, {100, 71}}) {
    const RgbImage out = resize_bilinear(gray, w, h);
    EXPECT_EQ(out.width, w);
    EXPECT_EQ(out.height, h);
    for (uint8_t v : out.pixels) ASSERT_EQ(v, 77) << w << "x" << h;
  }
}

TEST(ImageResize, HalvingAWidthByHand) {
  // 4 -> 2 columns: scale 2, support 2; output 0 has center 1 and taps x = 0, 1, 2 with
  // triangle weights 0.75, 0.75, 0.25 (then normalized), output 1 center 3, taps 1, 2, 3.
  RgbImage image(4, 1);
  const int values[4] = {0, 100, 200, 40};
  for (int x = 0; x < 4; ++x) image.pixels[3 * x] = image.pixels[3 * x + 1] = image.pixels[3 * x + 2] = values[x];
  const RgbImage out = resize_bilinear(image, 2, 1);
  const auto fixed = [](double w) { return static_cast<int64_t>(0.5 + w * (1 << 22)); };
  const auto expect = [&](std::initializer_list<int> taps, std::initializer_list<double> weights) {
    int64_t acc = 1 << 21;
    double sum = 0;
    for (double w : weights) sum += w;
    auto t = taps.begin();
    for (double w : weights) acc += values[*t++] * fixed(w / sum);
    return static_cast<int>(acc >> 22);
  };
  EXPECT_EQ(out.pixels[0], expect({0, 1, 2}, {0.75, 0.75, 0.25}));
  EXPECT_EQ(out.pixels[3], expect({1, 2, 3}, {0.25, 0.75, 0.75}));
  EXPECT_EQ(out.pixels[0], 71);  // (0 * 0.75 + 100 * 0.75 + 200 * 0.25) / 1.75 = 71.4
}

TEST(ImageResize, AWindowIsTheCropOfTheWholeResize) {
  const RgbImage image = pattern_image(53, 37, 9);
  for (auto [w, h] : {std::pair{20, 15}, {80, 61}, {53, 20}, {31, 37}}) {
    const RgbImage whole = resize_bilinear(image, w, h);
    for (auto [left, top, cw, ch] : {std::tuple{0, 0, w, h}, {3, 2, w - 5, h - 4}, {w - 1, h - 1, 1, 1}}) {
      const RgbImage window = resize_bilinear_window(image, w, h, left, top, cw, ch);
      for (int y = 0; y < ch; ++y)
        for (int i = 0; i < 3 * cw; ++i)
          ASSERT_EQ(window.row(y)[i], whole.row(top + y)[3 * left + i])
              << w << "x" << h << " at " << left << "," << top;
    }
  }
}

TEST(ImageBuckets, KohyaStyleListAroundTheArea) {
  const std::vector<ImageBucket> buckets = make_aspect_buckets(1024);
  std::set<std::pair<int, int>> seen;
  for (const auto& b : buckets) {
    EXPECT_EQ(b.width % 64, 0);
    EXPECT_EQ(b.height % 64, 0);
    EXPECT_LE(int64_t{b.width} * b.height, 1024 * 1024);
    EXPECT_GE(std::min(b.width, b.height), 512);
    EXPECT_LE(std::max(b.width, b.height), 2048);
    seen.insert({b.width, b.height});
  }
  for (const auto& b : buckets) EXPECT_TRUE(seen.count({b.height, b.width})) << image_bucket_name(b);
  EXPECT_TRUE(seen.count({1024, 1024}));
  EXPECT_TRUE(seen.count({832, 1216}));  // SDXL's and FLUX's familiar portrait bucket
  EXPECT_TRUE(seen.count({512, 2048}));
  EXPECT_TRUE(std::is_sorted(buckets.begin(), buckets.end(), [](ImageBucket a, ImageBucket b) {
    return a.width != b.width ? a.width < b.width : a.height < b.height;
  }));
  EXPECT_EQ(make_aspect_buckets(512, 64, 512, 512), (std::vector<ImageBucket>{{512, 512}}));
  expect_error([] { make_aspect_buckets(1000); }, {"resolution 1000", "multiple of 16"});
  expect_error([] { make_aspect_buckets(1024, 24); }, {"bucket step 24"});
  expect_error([] { make_aspect_buckets(1024, 64, 1100); }, {"bucket min_side 1100"});
  expect_error([] { make_aspect_buckets(1024, 64, 0, 1000); }, {"bucket max_side 1000"});
}

TEST(ImageBuckets, ParsedListsAreChecked) {
  EXPECT_EQ(parse_image_buckets("1024x1024, 832x1216,1216x832", "flux.buckets"),
            (std::vector<ImageBucket>{{1024, 1024}, {832, 1216}, {1216, 832}}));
  expect_error([] { parse_image_buckets("1024x1000", "flux.buckets"); },
               {"flux.buckets: bucket 1024x1000: sides must be multiples of 16"});
  expect_error([] { parse_image_buckets("1024*1024", "flux.buckets"); }, {"flux.buckets: '1024*1024' is not a bucket"});
  expect_error([] { parse_image_buckets("512x512,", "b"); }, {"b: '' is not a bucket"});
  expect_error([] { parse_image_buckets("512x512,512x512", "b"); }, {"b: bucket 512x512 is listed twice"});
  expect_error([] { parse_image_buckets("0x512", "b"); }, {"b: bucket 0x512"});
}

TEST(ImageBuckets, NearestAspectRatio) {
  const std::vector<ImageBucket> buckets = {{512, 512}, {768, 384}, {384, 768}, {640, 448}};
  EXPECT_EQ(nearest_bucket(1000, 1000, buckets), 0u);
  EXPECT_EQ(nearest_bucket(2000, 1000, buckets), 1u);
  EXPECT_EQ(nearest_bucket(1000, 2000, buckets), 2u);
  EXPECT_EQ(nearest_bucket(1430, 1000, buckets), 3u);  // 1.43: nearer 640/448 = 1.43 than 2 or 1
  // 1.2 is 1.2x from 1:1 and 1.19x from 640:448: the ratio of ratios decides, not the difference.
  EXPECT_EQ(nearest_bucket(1200, 1000, buckets), 3u);
  EXPECT_EQ(nearest_bucket(1195, 1000, buckets), 0u);
  // Ties go to the first listed: sqrt(2):1 is as far from 2:1 as from 1:1.
  EXPECT_EQ(nearest_bucket(1000, 1000, {{768, 384}, {512, 512}, {384, 768}}), 1u);
  EXPECT_EQ(nearest_bucket(1, 100000, buckets), 2u);
}

TEST(ImageTransform, SquareBucketIsTorchvisionsResizeAndCenterCrop) {
  ImageTransform center;
  // Resize(512) of 640x480: shorter side 512, longer int(512 * 640 / 480) = 682; crop left
  // int(round(170 / 2.0)) = 85.
  BucketPlacement p = place_in_bucket(640, 480, {512, 512}, center, 0);
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height, p.left, p.top, p.flip), std::tuple(682, 512, 85, 0, false));
  p = place_in_bucket(480, 641, {512, 512}, center, 0);  // int(512 * 641 / 480) = 683; round(85.5) = 86
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height, p.left, p.top), std::tuple(512, 683, 0, 86));
  // Python's round: halves to even.
  for (auto [spare, top] : {std::pair{1, 0}, {3, 2}, {5, 2}, {7, 4}, {0, 0}, {4, 2}}) {
    p = place_in_bucket(512, 512 + spare, {512, 512}, center, 0);
    EXPECT_EQ(p.top, top) << spare;
  }
  // A bucket of another shape: covered by the side that is relatively shorter.
  p = place_in_bucket(1000, 1000, {832, 1216}, center, 0);
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height, p.left, p.top), std::tuple(1216, 1216, 192, 0));
  p = place_in_bucket(3000, 2000, {1216, 832}, center, 0);
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height), std::tuple(1248, 832));
}

TEST(ImageTransform, RandomCropsAndFlipsDependOnSeedAndIndexOnly) {
  ImageTransform random;
  random.crop = ImageCrop::Random;
  random.random_flip = true;
  random.seed = 42;
  std::set<int> lefts;
  int flips = 0;
  for (uint64_t i = 0; i < 200; ++i) {
    const BucketPlacement p = place_in_bucket(900, 512, {512, 512}, random, i);
    EXPECT_GE(p.left, 0);
    EXPECT_LE(p.left, 900 - 512);
    EXPECT_EQ(p.top, 0);
    const BucketPlacement again = place_in_bucket(900, 512, {512, 512}, random, i);
    EXPECT_EQ(std::tuple(p.left, p.flip), std::tuple(again.left, again.flip));
    lefts.insert(p.left);
    flips += p.flip;
  }
  EXPECT_GT(lefts.size(), 100u);
  EXPECT_GT(flips, 70);
  EXPECT_LT(flips, 130);
  random.seed = 43;
  EXPECT_NE(place_in_bucket(900, 512, {512, 512}, random, 0).left,
            place_in_bucket(900, 512, {512, 512}, ImageTransform{ImageCrop::Random, true, 42}, 0).left);
}

TEST(ImageTransform, FlipMirrorsTheResizedImageBeforeTheCrop) {
  const RgbImage image = pattern_image(30, 20, 3);
  const ImageBucket bucket{16, 16};
  BucketPlacement p = place_in_bucket(30, 20, bucket, ImageTransform{}, 0);  // 24x16, left 4
  ASSERT_EQ(std::tuple(p.resized_width, p.left), std::tuple(24, 4));
  p.left = 1;
  p.flip = true;
  const RgbImage flipped = fit_to_bucket(image, bucket, p);
  const RgbImage resized = resize_bilinear(image, 24, 16);
  for (int y = 0; y < 16; ++y)
    for (int x = 0; x < 16; ++x)
      for (int c = 0; c < 3; ++c)  // column x of the window at 1 of the mirrored image
        ASSERT_EQ(flipped.row(y)[3 * x + c], resized.row(y)[3 * (24 - 1 - (1 + x)) + c]);
}

TEST(ImageTransform, NormalizedLikeToTensorThenNormalize) {
  RgbImage image(2, 1);
  image.pixels = {0, 255, 128, 1, 2, 3};
  const Tensor t = normalized_chw(image);
  EXPECT_EQ(t.shape(), (Shape{3, 1, 2}));
  const float* v = t.data<float>();
  EXPECT_EQ(v[0], -1.0f);  // R of pixel 0
  EXPECT_EQ(v[1], (1.0f / 255.0f - 0.5f) / 0.5f);
  EXPECT_EQ(v[2], 1.0f);  // G of pixel 0
  EXPECT_EQ(v[4], (128.0f / 255.0f - 0.5f) / 0.5f);
  EXPECT_EQ(v[5], (3.0f / 255.0f - 0.5f) / 0.5f);
}

}  // namespace
}  // namespace forge
