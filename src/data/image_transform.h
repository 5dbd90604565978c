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
//
// NOTE [torchtitan's Flux.1 image transform]
// MLPerf Training's Flux.1 reference (torchtitan experiments/flux, _process_cc12m_image in
// dataset/flux_dataset.py) makes a S x S image (S = 256) otherwise:
//   skip the image when width < S or height < S (training data; COCO validation keeps all)
//   width >= height: resize to (ceil(S / height * width), S), crop at left = uniform in
//                    [0, new_w - S]; else to (S, ceil(S / width * height)), top likewise
//   img.resize(size) with Pillow's default filter: BICUBIC (Pillow 13.0.0, checked: every
//                    mode but "1" and "P" gets BICUBIC when no resample is given)
//   convert("RGB") when the mode is not RGB, then p / 255.0 * 2.0 - 1.0 in float32, CHW
// forge's ImageTransformKind::Torchtitan does the same: the ceil of the float64 quotient
// S / height times width, in that order, as Python computes it (so 273 x 182 becomes
// 385 x 256: 256.0 / 182 * 273 rounds above the exact 384), the bicubic window of
// NOTE [PIL's bilinear resize], no flip, and the offset drawn from forge's Rng seeded by
// (seed, the image's index) like the diffusers transform's random crops, not torch's
// generator. The skip is --min-size (image_too_small, from the file's header before any
// decoding), which applies to either transform. In float32, p / 255 * 2 - 1 equals
// (p / 255 - 0.5) / 0.5 for every p (scaling by 2 commutes with the rounding), so both
// transforms share normalized_chw.
// Where forge and the reference part (decoding converts to RGB first, NOTE [Image
// decoding]; the reference resizes in the file's own mode and converts after):
//   RGB, L (grayscale): the same bytes: Pillow resizes each channel alone with the same
//       weights, so resizing L then replicating it equals replicating then resizing.
//   RGBA, LA: Pillow resizes them premultiplied by alpha (RGBa, La) and divides back
//       before convert("RGB") drops alpha; forge drops alpha first. Equal where alpha is
//       255 throughout the filter's footprint; elsewhere they differ (random alpha, 97x61
//       to 40x30: 97% of the bytes, by up to 62 levels).
//   P (palette): Pillow resizes palette images with NEAREST whatever the filter asks;
//       forge expands the palette and resizes bicubically. Different (up to 175 levels).
//   CMYK JPEG: Pillow resizes the inks, then converts (R = nk - C nk / 255, nk = 255 - K,
//       not linear); forge converts, then resizes. Equal where K = 0, different otherwise
//       (random inks: 94% of the bytes, by up to 29 levels).
//   forge would need its decoders to hand over the file's own mode (alpha, palette
//       indices, inks) to do as the reference does; they do not (NOTE [Image decoding]).
//   EXIF orientation: forge turns images upright before measuring them (as diffusers
//       does). The reference measures what its loader hands it: recent releases of
//       Hugging Face datasets apply ImageOps.exif_transpose in Image.decode_example when
//       the file has an Orientation tag, the same as forge; older releases did not (which
//       one MLPerf's reference pins was not checked here), and then rotated images differ.
// CC12M and COCO are almost all JPEG files in RGB or L, where the transform is exact given
// the decoded pixels (python.test_image_decode_vs_pil drives it against a restatement of
// _process_cc12m_image); the JPEG decoding itself agrees with Pillow's bundled
// libjpeg-turbo within 2 levels (NOTE [JPEG decoding]).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/image_buckets.h"
#include "data/image_resize.h"
#include "data/image_rgb.h"

namespace forge {

enum class ImageCrop { Center, Random };

// NOTE [FLUX image transform] (Diffusers) or NOTE [torchtitan's Flux.1 image transform].
enum class ImageTransformKind { Diffusers, Torchtitan };

struct ImageTransform {
  ImageCrop crop = ImageCrop::Center;
  bool random_flip = false;  // mirror each image with probability 0.5 (diffusers' --random_flip)
  uint64_t seed = 0;         // of the random crops and flips
  ImageTransformKind kind = ImageTransformKind::Diffusers;  // Torchtitan: always a random crop, never a flip
  int64_t min_size = 0;  // images narrower or lower than this are skipped (0: none)
};

// "diffusers" or "torchtitan"; anything else fails naming `flag`.
ImageTransformKind parse_image_transform_kind(const std::string& name, const char* flag);
const char* image_transform_kind_name(ImageTransformKind kind);

// Fails, naming the flags, when `transform` cannot apply to `buckets`: torchtitan's takes
// one square bucket, and a center crop (crop_given: --crop was given) or a flip does not
// apply to it; min_size must lie in [0, 65536].
void check_image_transform(const ImageTransform& transform, const std::vector<ImageBucket>& buckets,
                           bool crop_given);

// Whether a width x height image is skipped under transform.min_size (either side below it).
bool image_too_small(int width, int height, const ImageTransform& transform);

// Where a width x height image lands in a bucket: the size it is resized to (covering the
// bucket), the window of that resized image that is kept, and whether it is mirrored.
struct BucketPlacement {
  int resized_width = 0, resized_height = 0;
  int left = 0, top = 0;  // of the window in the (mirrored, when flip) resized image
  bool flip = false;
  ResampleFilter filter = ResampleFilter::Bilinear;  // Bicubic for Torchtitan
};

BucketPlacement place_in_bucket(int width, int height, ImageBucket bucket, const ImageTransform& transform,
                                uint64_t index);

// The bucket-sized 8-bit image that `placement` makes of `image`.
RgbImage fit_to_bucket(const RgbImage& image, ImageBucket bucket, const BucketPlacement& placement);

// A float32 CPU tensor [3, height, width] in [-1, 1]: (p / 255 - 0.5) / 0.5 per channel,
// which in float32 is also torchtitan's p / 255 * 2 - 1 bit for bit.
Tensor normalized_chw(const RgbImage& image);

}  // namespace forge
