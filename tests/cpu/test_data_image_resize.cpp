// Pillow's bilinear and bicubic resize (data/image_resize.h), resolution buckets
// (data/image_buckets.h) and the FLUX image transforms, diffusers' and torchtitan's
// (data/image_transform.h). Byte-for-byte agreement with
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

double keys_cubic(double x) {  // a = -0.5, as NOTE [PIL's bilinear resize] states it
  x = std::abs(x);
  if (x < 1) return (1.5 * x - 2.5) * x * x + 1;
  if (x < 2) return ((-0.5 * x + 2.5) * x - 4) * x + 2;
  return 0;
}

TEST(ImageResize, BicubicSameSizeIsTheIdentityAndConstantsStayConstant) {
  const RgbImage image = pattern_image(17, 11);
  EXPECT_EQ(resize_image(image, 17, 11, ResampleFilter::Bicubic).pixels, image.pixels);
  RgbImage gray(13, 9);
  std::fill(gray.pixels.begin(), gray.pixels.end(), 77);
  for (auto [w, h] : {std::pair{1, 1}, {5, 30}, {40, 3}, {13, 9}, {100, 71}}) {
    const RgbImage out = resize_image(gray, w, h, ResampleFilter::Bicubic);
    EXPECT_EQ(std::pair(out.width, out.height), std::pair(w, h));
    for (uint8_t v : out.pixels) ASSERT_EQ(v, 77) << w << "x" << h;
  }
}

TEST(ImageResize, BicubicHalvingAWidthByHand) {
  // 6 -> 3 columns: scale 2, support 4; output 1 has center 3 and taps x = 0..5 (xmin =
  // int(3 - 4 + 0.5) = 0, xmax = min(6, int(7.5))) at t = (x - 3 + 0.5) / 2: weights
  // -0.0703, 0.2266, 0.8672, 0.8672, 0.2266, -0.0703 before normalizing.
  RgbImage image(6, 1);
  const int values[6] = {200, 10, 50, 240, 30, 220};
  for (int x = 0; x < 6; ++x) image.pixels[3 * x] = image.pixels[3 * x + 1] = image.pixels[3 * x + 2] = values[x];
  const RgbImage out = resize_image(image, 3, 1, ResampleFilter::Bicubic);
  double k[6], sum = 0;
  for (int x = 0; x < 6; ++x) sum += k[x] = keys_cubic((x - 3 + 0.5) / 2);
  EXPECT_LT(k[0], 0);
  EXPECT_LT(k[5], 0);
  int64_t acc = 1 << 21;
  for (int x = 0; x < 6; ++x) {
    const double w = k[x] / sum;
    acc += values[x] * static_cast<int64_t>(w < 0 ? -0.5 + w * (1 << 22) : 0.5 + w * (1 << 22));
  }
  EXPECT_EQ(out.pixels[3], static_cast<int>(acc >> 22));
  EXPECT_EQ(out.pixels[3], 113);  // the weighted mean 112.86, rounded
  // An edge that overshoots clips at 0 and 255 instead of wrapping.
  RgbImage edge(8, 1);
  for (int x = 0; x < 8; ++x) edge.pixels[3 * x] = edge.pixels[3 * x + 1] = edge.pixels[3 * x + 2] = x < 4 ? 0 : 255;
  const RgbImage up = resize_image(edge, 29, 1, ResampleFilter::Bicubic);
  EXPECT_EQ(up.pixels.front(), 0);
  EXPECT_EQ(up.pixels.back(), 255);
}

TEST(ImageResize, ABicubicWindowIsTheCropOfTheWholeResize) {
  const RgbImage image = pattern_image(53, 37, 9);
  // (53, 10): the height shrinks most, so the vertical pass runs first.
  for (auto [w, h] : {std::pair{20, 15}, {80, 61}, {53, 10}, {31, 37}}) {
    const RgbImage whole = resize_image(image, w, h, ResampleFilter::Bicubic);
    for (auto [left, top, cw, ch] : {std::tuple{0, 0, w, h}, {3, 2, w - 5, h - 4}, {w - 1, h - 1, 1, 1}}) {
      if (cw < 1 || ch < 1) continue;
      const RgbImage window = resize_image_window(image, w, h, left, top, cw, ch, ResampleFilter::Bicubic);
      for (int y = 0; y < ch; ++y)
        for (int i = 0; i < 3 * cw; ++i)
          ASSERT_EQ(window.row(y)[i], whole.row(top + y)[3 * left + i])
              << w << "x" << h << " at " << left << "," << top;
    }
  }
  EXPECT_NE(resize_image(image, 20, 15, ResampleFilter::Bicubic).pixels, resize_bilinear(image, 20, 15).pixels);
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

ImageTransform torchtitan(uint64_t seed = 0, int64_t min_size = 0) {
  ImageTransform t;
  t.kind = ImageTransformKind::Torchtitan;
  t.crop = ImageCrop::Random;
  t.seed = seed;
  t.min_size = min_size;
  return t;
}

TEST(TorchtitanTransform, CeilOfTheFloat64QuotientAsPythonComputesIt) {
  // ceil(256 / 480 * 640) = ceil(341.33) = 342 (diffusers' rule truncates to 341).
  BucketPlacement p = place_in_bucket(640, 480, {256, 256}, torchtitan(), 0);
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height, p.top), std::tuple(342, 256, 0));
  EXPECT_EQ(p.filter, ResampleFilter::Bicubic);
  EXPECT_EQ(place_in_bucket(640, 480, {256, 256}, ImageTransform{}, 0).resized_width, 341);
  // 256 * 273 / 182 is exactly 384, but Python's 256 / 182 * 273 is 384.00000000000006.
  p = place_in_bucket(273, 182, {256, 256}, torchtitan(), 0);
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height), std::tuple(385, 256));
  p = place_in_bucket(182, 273, {256, 256}, torchtitan(), 0);  // portrait: the same on the height
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height, p.left), std::tuple(256, 385, 0));
  p = place_in_bucket(300, 300, {256, 256}, torchtitan(), 5);  // square: width >= height, nothing spare
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height, p.left, p.top), std::tuple(256, 256, 0, 0));
  p = place_in_bucket(100, 50, {256, 256}, torchtitan(), 0);  // small images are enlarged
  EXPECT_EQ(std::tuple(p.resized_width, p.resized_height), std::tuple(512, 256));
  expect_error([] { place_in_bucket(640, 480, {256, 128}, torchtitan(), 0); }, {"square bucket", "256x128"});
}

TEST(TorchtitanTransform, RandomCropAlongTheLongerSideFromSeedAndIndex) {
  std::set<int> lefts, tops;
  for (uint64_t i = 0; i < 200; ++i) {
    const BucketPlacement wide = place_in_bucket(700, 400, {256, 256}, torchtitan(7), i);
    ASSERT_EQ(wide.resized_width, 448);  // ceil(256 / 400 * 700) = 448
    EXPECT_TRUE(wide.left >= 0 && wide.left <= 448 - 256 && wide.top == 0 && !wide.flip);
    EXPECT_EQ(wide.left, place_in_bucket(700, 400, {256, 256}, torchtitan(7), i).left);
    lefts.insert(wide.left);
    const BucketPlacement tall = place_in_bucket(400, 700, {256, 256}, torchtitan(7), i);
    EXPECT_TRUE(tall.top >= 0 && tall.top <= 448 - 256 && tall.left == 0 && !tall.flip);
    tops.insert(tall.top);
  }
  EXPECT_GT(lefts.size(), 100u);
  EXPECT_GT(tops.size(), 100u);
  EXPECT_TRUE(lefts.count(0) || lefts.count(192) || lefts.size() > 150);
  EXPECT_NE(place_in_bucket(700, 400, {256, 256}, torchtitan(7), 0).left +
                place_in_bucket(700, 400, {256, 256}, torchtitan(7), 1).left * 1000,
            place_in_bucket(700, 400, {256, 256}, torchtitan(8), 0).left +
                place_in_bucket(700, 400, {256, 256}, torchtitan(8), 1).left * 1000);
}

TEST(TorchtitanTransform, MinSizeSkipsImagesWithEitherSideBelowIt) {
  EXPECT_FALSE(image_too_small(1, 1, torchtitan()));  // 0 keeps all
  EXPECT_FALSE(image_too_small(256, 256, torchtitan(0, 256)));
  EXPECT_TRUE(image_too_small(255, 4000, torchtitan(0, 256)));
  EXPECT_TRUE(image_too_small(4000, 255, torchtitan(0, 256)));
  ImageTransform diffusers;
  diffusers.min_size = 512;
  EXPECT_TRUE(image_too_small(511, 600, diffusers));
  EXPECT_FALSE(image_too_small(512, 600, diffusers));
}

TEST(TorchtitanTransform, FlagsAreChecked) {
  EXPECT_EQ(parse_image_transform_kind("diffusers", "--transform"), ImageTransformKind::Diffusers);
  EXPECT_EQ(parse_image_transform_kind("torchtitan", "--transform"), ImageTransformKind::Torchtitan);
  EXPECT_STREQ(image_transform_kind_name(ImageTransformKind::Torchtitan), "torchtitan");
  expect_error([] { parse_image_transform_kind("mlperf", "--transform"); },
               {"--transform 'mlperf'", "diffusers", "torchtitan"});
  check_image_transform(torchtitan(0, 256), {{256, 256}}, false);
  check_image_transform(ImageTransform{}, make_aspect_buckets(1024), true);  // diffusers: any buckets
  expect_error([] { check_image_transform(torchtitan(), make_aspect_buckets(1024), false); },
               {"--transform torchtitan", "one square bucket", "--buckets gives", " buckets)"});
  expect_error([] { check_image_transform(torchtitan(), {{256, 512}}, false); }, {"--buckets gives 256x512"});
  expect_error([] { check_image_transform(torchtitan(), {{256, 256}, {512, 512}}, false); },
               {"--buckets gives 256x256,512x512"});
  ImageTransform flipped = torchtitan();
  flipped.random_flip = true;
  expect_error([&] { check_image_transform(flipped, {{256, 256}}, false); }, {"--random-flip", "never mirrors"});
  expect_error([] { check_image_transform(torchtitan(), {{256, 256}}, true); }, {"--crop does not apply"});
  for (int64_t bad : {int64_t{-1}, int64_t{65537}, int64_t{1} << 40}) {
    ImageTransform t;
    t.min_size = bad;
    expect_error([&] { check_image_transform(t, {{256, 256}}, false); }, {fmt::format("--min-size {}", bad)});
  }
}

}  // namespace
}  // namespace forge
