#include "data/image_transform.h"

#include <array>
#include <cstdint>
#include <utility>

#include "core/error.h"
#include "core/rng.h"
#include "data/image_resize.h"

namespace forge {
namespace {

// Python's int(round(d / 2.0)) of a non-negative integer d: halves go to the even side.
int half_rounded_to_even(int d) {
  int half = d / 2;
  if (d % 2 == 1 && half % 2 == 1) ++half;
  return half;
}

}  // namespace

BucketPlacement place_in_bucket(int width, int height, ImageBucket bucket, const ImageTransform& transform,
                                uint64_t index) {
  FORGE_CHECK(width > 0 && height > 0 && bucket.width > 0 && bucket.height > 0, "placing {}x{} in bucket {}", width,
              height, image_bucket_name(bucket));
  BucketPlacement p;
  int64_t resized_width, resized_height;
  if (static_cast<int64_t>(width) * bucket.height >= static_cast<int64_t>(height) * bucket.width) {
    resized_height = bucket.height;  // relatively wider than the bucket: match heights
    resized_width = static_cast<int64_t>(bucket.height) * width / height;
  } else {
    resized_width = bucket.width;
    resized_height = static_cast<int64_t>(bucket.width) * height / width;
  }
  if (resized_width > INT32_MAX || resized_height > INT32_MAX)
    FORGE_FAIL("an image of {}x{} would be resized to {}x{} to cover bucket {}", width, height, resized_width,
               resized_height, image_bucket_name(bucket));
  p.resized_width = static_cast<int>(resized_width);
  p.resized_height = static_cast<int>(resized_height);
  const int spare_x = p.resized_width - bucket.width, spare_y = p.resized_height - bucket.height;
  if (transform.crop == ImageCrop::Center && !transform.random_flip) {
    p.left = half_rounded_to_even(spare_x);
    p.top = half_rounded_to_even(spare_y);
    return p;
  }
  Rng rng(derive_seed(transform.seed, index));
  p.flip = transform.random_flip && rng.uniform() < 0.5;
  if (transform.crop == ImageCrop::Center) {
    p.left = half_rounded_to_even(spare_x);
    p.top = half_rounded_to_even(spare_y);
  } else {
    p.top = static_cast<int>(rng.below(static_cast<uint64_t>(spare_y) + 1));
    p.left = static_cast<int>(rng.below(static_cast<uint64_t>(spare_x) + 1));
  }
  return p;
}

RgbImage fit_to_bucket(const RgbImage& image, ImageBucket bucket, const BucketPlacement& placement) {
  // Mirroring before the crop: the window at `left` of the mirrored image is the mirrored
  // window at resized_width - left - bucket.width of the unmirrored one.
  const int left = placement.flip ? placement.resized_width - placement.left - bucket.width : placement.left;
  RgbImage out = resize_bilinear_window(image, placement.resized_width, placement.resized_height, left, placement.top,
                                        bucket.width, bucket.height);
  if (placement.flip) {
    for (int y = 0; y < out.height; ++y) {
      uint8_t* row = out.row(y);
      for (int a = 0, b = out.width - 1; a < b; ++a, --b)
        for (int c = 0; c < 3; ++c) std::swap(row[3 * a + c], row[3 * b + c]);
    }
  }
  return out;
}

Tensor normalized_chw(const RgbImage& image) {
  std::array<float, 256> value;
  for (int p = 0; p < 256; ++p) value[p] = (static_cast<float>(p) / 255.0f - 0.5f) / 0.5f;
  Tensor out = Tensor::empty({3, image.height, image.width}, DType::F32);
  float* data = out.data<float>();
  const size_t plane = static_cast<size_t>(image.width) * static_cast<size_t>(image.height);
  for (size_t i = 0; i < plane; ++i)
    for (int c = 0; c < 3; ++c) data[c * plane + i] = value[image.pixels[3 * i + c]];
  return out;
}

}  // namespace forge
