#include "data/image_transform.h"

#include <array>
#include <cmath>
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

// NOTE [torchtitan's Flux.1 image transform]: the longer side is the ceil of the float64
// S / shorter * longer, the crop uniform along it.
BucketPlacement place_torchtitan(int width, int height, ImageBucket bucket, const ImageTransform& transform,
                                 uint64_t index) {
  FORGE_CHECK(bucket.width == bucket.height, "torchtitan's transform takes a square bucket, not {}",
              image_bucket_name(bucket));
  const double side = bucket.width;
  BucketPlacement p;
  p.filter = ResampleFilter::Bicubic;
  const bool wide = width >= height;
  const double longer = wide ? std::ceil(side / height * width) : std::ceil(side / width * height);
  if (longer > INT32_MAX)
    FORGE_FAIL("an image of {}x{} would be resized to a side of {} to cover bucket {}", width, height, longer,
               image_bucket_name(bucket));
  p.resized_width = wide ? static_cast<int>(longer) : bucket.width;
  p.resized_height = wide ? bucket.height : static_cast<int>(longer);
  const int spare = static_cast<int>(longer) - bucket.width;
  Rng rng(derive_seed(transform.seed, index));
  (wide ? p.left : p.top) = static_cast<int>(rng.below(static_cast<uint64_t>(spare) + 1));
  return p;
}

}  // namespace

ImageTransformKind parse_image_transform_kind(const std::string& name, const char* flag) {
  if (name == "diffusers") return ImageTransformKind::Diffusers;
  if (name == "torchtitan") return ImageTransformKind::Torchtitan;
  FORGE_FAIL("{} '{}': expected diffusers (diffusers' FLUX scripts: bilinear, any buckets) or torchtitan (MLPerf's "
             "Flux.1 reference: bicubic, one square bucket, random crops)",
             flag, name);
}

const char* image_transform_kind_name(ImageTransformKind kind) {
  return kind == ImageTransformKind::Torchtitan ? "torchtitan" : "diffusers";
}

void check_image_transform(const ImageTransform& transform, const std::vector<ImageBucket>& buckets,
                           bool crop_given) {
  if (transform.min_size < 0 || transform.min_size > 65536)
    FORGE_FAIL("--min-size {}: expected the smallest width and height kept, from 0 (keep all) to 65536",
               transform.min_size);
  if (transform.kind != ImageTransformKind::Torchtitan) return;
  if (buckets.size() != 1 || buckets[0].width != buckets[0].height) {
    std::string given;
    for (size_t i = 0; i < buckets.size() && i < 4; ++i) given += (i ? "," : "") + image_bucket_name(buckets[i]);
    if (buckets.size() > 4) given += fmt::format(",... ({} buckets)", buckets.size());
    FORGE_FAIL(
        "--transform torchtitan places every image in one square bucket of --resolution (--buckets square), as "
        "MLPerf's Flux.1 reference does; --buckets gives {}",
        given);
  }
  if (transform.random_flip)
    FORGE_FAIL("--random-flip does not apply to --transform torchtitan (the reference never mirrors images)");
  if (crop_given)
    FORGE_FAIL("--crop does not apply to --transform torchtitan (its crop is always random along the longer side)");
}

bool image_too_small(int width, int height, const ImageTransform& transform) {
  return width < transform.min_size || height < transform.min_size;
}

BucketPlacement place_in_bucket(int width, int height, ImageBucket bucket, const ImageTransform& transform,
                                uint64_t index) {
  FORGE_CHECK(width > 0 && height > 0 && bucket.width > 0 && bucket.height > 0, "placing {}x{} in bucket {}", width,
              height, image_bucket_name(bucket));
  if (transform.kind == ImageTransformKind::Torchtitan)
    return place_torchtitan(width, height, bucket, transform, index);
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
  RgbImage out = resize_image_window(image, placement.resized_width, placement.resized_height, left, placement.top,
                                     bucket.width, bucket.height, placement.filter);
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
