// Resolution buckets: the image sizes a FLUX run trains at.
//
// NOTE [Aspect-ratio buckets]
// A bucket is a (width, height) in pixels, both multiples of 16 (the VAE downsamples by 8,
// the transformer patchifies 2x2), and every image of a batch shares one. diffusers' FLUX
// fine-tuning scripts use a single square bucket, resolution x resolution. kohya's
// sd-scripts and SimpleTuner instead train at several aspect ratios of about the same area;
// make_aspect_buckets builds that list as kohya's make_bucket_resolutions does:
//   the square floor(resolution / step) step on each side, and for every width w from
//   min_side to max_side in steps of `step`, the height h = min(max_side, floor(resolution^2 /
//   w / step) step) when h >= min_side, with (w, h) and (h, w) both added;
// sorted by (width, height). Defaults: step 64 (kohya's bucket_reso_steps), min_side
// resolution / 2, max_side 2 x resolution. Lists can also be given explicitly
// ("1024x1024,832x1216,1216x832").
// An image goes to the bucket whose aspect ratio is nearest to its own (upright) one, by
// the ratio of the two ratios (so 2:1 is as far from 1:1 as 1:2 is; kohya compares w/h by
// difference), the first in the list on a tie; it is then resized to cover the bucket and
// cropped (NOTE [FLUX image transform]).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace forge {

struct ImageBucket {
  int width = 0, height = 0;
  bool operator==(const ImageBucket&) const = default;
};

// "832x1216"
std::string image_bucket_name(ImageBucket bucket);

// Throws a forge::Error naming `what` unless both sides are multiples of 16 in [16, 16384].
void check_image_bucket(ImageBucket bucket, std::string_view what);

// The kohya-style bucket list of NOTE [Aspect-ratio buckets]; min_side and max_side of 0
// take their defaults. Throws naming the bad argument (`resolution`, `step`, ...) unless
// resolution is a multiple of 16 in [16, 16384], step a positive multiple of 16, and
// min_side <= resolution <= max_side multiples of step.
std::vector<ImageBucket> make_aspect_buckets(int resolution, int step = 64, int min_side = 0, int max_side = 0);

// A comma-separated list of WxH buckets; throws naming `what` for a malformed or invalid
// entry, an empty list or a bucket listed twice.
std::vector<ImageBucket> parse_image_buckets(std::string_view text, std::string_view what);

// The index of the bucket nearest in aspect ratio to a width x height image.
size_t nearest_bucket(int width, int height, const std::vector<ImageBucket>& buckets);

}  // namespace forge
