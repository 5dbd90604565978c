#include "data/image_buckets.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>

#include "core/error.h"

namespace forge {

std::string image_bucket_name(ImageBucket bucket) { return fmt::format("{}x{}", bucket.width, bucket.height); }

void check_image_bucket(ImageBucket bucket, std::string_view what) {
  for (int side : {bucket.width, bucket.height}) {
    if (side < 16 || side > 16384 || side % 16 != 0)
      FORGE_FAIL("{}: bucket {}: sides must be multiples of 16 from 16 to 16384 (the VAE's 8x and the 2x2 patches)",
                 what, image_bucket_name(bucket));
  }
}

std::vector<ImageBucket> make_aspect_buckets(int resolution, int step, int min_side, int max_side) {
  if (resolution < 16 || resolution > 16384 || resolution % 16 != 0)
    FORGE_FAIL("resolution {}: expected a multiple of 16 from 16 to 16384", resolution);
  if (step < 16 || step % 16 != 0) FORGE_FAIL("bucket step {}: expected a positive multiple of 16", step);
  if (min_side == 0) min_side = std::max(step, resolution / 2 / step * step);
  if (max_side == 0) max_side = std::min(16384 / step * step, 2 * resolution / step * step);
  if (min_side < step || min_side % step != 0 || min_side > resolution)
    FORGE_FAIL("bucket min_side {}: expected a multiple of the step {} from {} to the resolution {}", min_side, step,
               step, resolution);
  if (max_side % step != 0 || max_side < resolution || max_side > 16384)
    FORGE_FAIL("bucket max_side {}: expected a multiple of the step {} from the resolution {} to 16384", max_side, step,
               resolution);
  const int64_t area = static_cast<int64_t>(resolution) * resolution;
  std::vector<ImageBucket> buckets;
  const int square = resolution / step * step;
  buckets.push_back({square, square});
  for (int w = min_side; w <= max_side; w += step) {
    const int h = static_cast<int>(std::min<int64_t>(max_side, area / w / step * step));
    if (h >= min_side) {
      buckets.push_back({w, h});
      buckets.push_back({h, w});
    }
  }
  std::sort(buckets.begin(), buckets.end(),
            [](ImageBucket a, ImageBucket b) { return a.width != b.width ? a.width < b.width : a.height < b.height; });
  buckets.erase(std::unique(buckets.begin(), buckets.end()), buckets.end());
  return buckets;
}

std::vector<ImageBucket> parse_image_buckets(std::string_view text, std::string_view what) {
  std::vector<ImageBucket> buckets;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t comma = std::min(text.find(',', pos), text.size());
    std::string_view item = text.substr(pos, comma - pos);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    const size_t x = item.find('x');
    ImageBucket bucket;
    const auto parse = [](std::string_view digits, int& value) {
      const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
      return !digits.empty() && ec == std::errc() && end == digits.data() + digits.size();
    };
    if (x == std::string_view::npos || !parse(item.substr(0, x), bucket.width) ||
        !parse(item.substr(x + 1), bucket.height))
      FORGE_FAIL("{}: '{}' is not a bucket: expected WIDTHxHEIGHT, such as 1024x1024, in a comma-separated list", what,
                 item);
    check_image_bucket(bucket, what);
    if (std::find(buckets.begin(), buckets.end(), bucket) != buckets.end())
      FORGE_FAIL("{}: bucket {} is listed twice", what, image_bucket_name(bucket));
    buckets.push_back(bucket);
    pos = comma + 1;
  }
  return buckets;
}

size_t nearest_bucket(int width, int height, const std::vector<ImageBucket>& buckets) {
  FORGE_CHECK(!buckets.empty() && width > 0 && height > 0, "nearest_bucket of {}x{} among {} buckets", width, height,
              buckets.size());
  // How far the image's aspect ratio is from bucket i's, as the fraction hi/lo >= 1 of the
  // cross products width * bucket height and height * bucket width: compared exactly.
  struct Distance {
    __int128 hi, lo;
  };
  const auto distance = [&](ImageBucket b) {
    const __int128 a = static_cast<__int128>(width) * b.height, c = static_cast<__int128>(height) * b.width;
    return a >= c ? Distance{a, c} : Distance{c, a};
  };
  size_t best = 0;
  Distance best_distance = distance(buckets[0]);
  for (size_t i = 1; i < buckets.size(); ++i) {
    const Distance d = distance(buckets[i]);
    if (d.hi * best_distance.lo < best_distance.hi * d.lo) {
      best = i;
      best_distance = d;
    }
  }
  return best;
}

}  // namespace forge
