// Fixture images for the image tests: deterministic RGB patterns, written as PNG with
// forge's own writer (data/image_png.h).
#pragma once

#include <cstdint>
#include <string>

#include "core/rng.h"
#include "data/image_png.h"
#include "data/image_rgb.h"

namespace forge {

// A smooth pattern with noise, different in each channel, from `seed`.
inline RgbImage pattern_image(int width, int height, uint64_t seed = 1) {
  RgbImage image(width, height);
  Rng rng(seed);
  for (int y = 0; y < height; ++y)
    for (int x = 0; x < width; ++x)
      for (int c = 0; c < 3; ++c) {
        const int smooth = (x * (c + 1) * 255 / width + y * (3 - c) * 255 / height) / 4;
        image.row(y)[3 * x + c] = static_cast<uint8_t>((smooth + static_cast<int>(rng.below(64))) % 256);
      }
  return image;
}

inline void write_pattern_png(const std::string& path, int width, int height, uint64_t seed = 1) {
  write_png_file(path, pattern_image(width, height, seed));
}

}  // namespace forge
