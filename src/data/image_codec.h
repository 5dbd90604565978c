// What the per-format decoders (image_jpeg, image_png, image_webp) share: their results
// and the size limit every one checks before it allocates pixels. data/image_decode.h is
// the entry point the rest of forge calls.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "data/image_rgb.h"

namespace forge {

// The largest image forge decodes, in pixels: Pillow's DecompressionBombError threshold
// (2 x Image.MAX_IMAGE_PIXELS), so that forge refuses what diffusers' loaders refuse and a
// small hostile file cannot make it allocate gigabytes.
inline constexpr int64_t kMaxImagePixels = 178956970;

// The size and EXIF block of an image, read from its header without decoding pixels.
struct ImageHeader {
  int width = 0, height = 0;
  std::string exif;  // the EXIF block as stored (a TIFF structure, maybe behind "Exif\0\0"); empty if none
};

struct DecodedImage {
  RgbImage image;    // as stored, before any EXIF orientation
  std::string exif;  // as in ImageHeader
};

// Throws "<name>: <format> image of <w>x<h> pixels: ..." when a side is not positive or
// the image holds more than kMaxImagePixels.
void check_image_dimensions(const std::string& name, std::string_view format, int64_t width, int64_t height);

}  // namespace forge
