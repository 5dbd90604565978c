// From a decoded image to the float tensor a FLUX VAE encodes: resize, crop, flip, normalize.
//
// NOTE [FLUX image transform]
// diffusers' FLUX fine-tuning scripts (train_dreambooth_lora_flux.py, with a square bucket
// resolution x resolution) run, per image, after exif_transpose and convert("RGB"):
//   Resize(resolution, BILINEAR)   the shorter side to `resolution`, the longer one to
//                                  int(resolution * long / short) (torchvision, truncating),
//                                  with Pillow's antialiased bilinear filter
//   RandomHorizontalFlip           with --random_flip, each image with probability 0.5
//   CenterCrop or RandomCrop       center: top = int(round((H - h) / 2.0)) with Python's
//                                  round-half-to-even, left likewise; random: uniform offsets
//   ToTensor, Normalize([0.5],[0.5]) x = (p / 255 - 0.5) / 0.5 in float32, CHW
// forge does the same for any bucket: an image of W x H goes to bucket (w, h) by scaling to
// cover it, the side that is relatively shorter to the bucket's and the other truncated as
// torchvision does (for a square bucket exactly torchvision's Resize(resolution)), then the
// flip and the crop as above, computing only the cropped window of the resized image (NOTE
// [PIL's bilinear resize]). The float conversion is the same float32 arithmetic as
// torchvision's, so a center-cropped tensor equals diffusers' bit for bit. Random crops and
// flips draw from forge's counter-based Rng seeded by (seed, the image's index), so an
// image's crop does not depend on which thread or in which order it is prepared; they are
// not torch's random numbers.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "data/image_buckets.h"
#include "data/image_rgb.h"

namespace forge {

enum class ImageCrop { Center, Random };

struct ImageTransform {
  ImageCrop crop = ImageCrop::Center;
  bool random_flip = false;  // mirror each image with probability 0.5 (diffusers' --random_flip)
  uint64_t seed = 0;         // of the random crops and flips
};

// Where a width x height image lands in a bucket: the size it is resized to (covering the
// bucket), the window of that resized image that is kept, and whether it is mirrored.
struct BucketPlacement {
  int resized_width = 0, resized_height = 0;
  int left = 0, top = 0;  // of the window in the (mirrored, when flip) resized image
  bool flip = false;
};

BucketPlacement place_in_bucket(int width, int height, ImageBucket bucket, const ImageTransform& transform,
                                uint64_t index);

// The bucket-sized 8-bit image that `placement` makes of `image`.
RgbImage fit_to_bucket(const RgbImage& image, ImageBucket bucket, const BucketPlacement& placement);

// A float32 CPU tensor [3, height, width] in [-1, 1]: (p / 255 - 0.5) / 0.5 per channel.
Tensor normalized_chw(const RgbImage& image);

}  // namespace forge
