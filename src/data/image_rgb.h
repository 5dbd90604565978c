// An 8-bit RGB image in memory: what every image decoder of data/ produces and what the
// resize, the crops and the PNG writer take.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace forge {

struct RgbImage {
  int width = 0, height = 0;
  std::vector<uint8_t> pixels;  // height rows of width (R, G, B) triples, top row first

  RgbImage() = default;
  RgbImage(int w, int h) : width(w), height(h), pixels(static_cast<size_t>(w) * static_cast<size_t>(h) * 3) {}

  uint8_t* row(int y) { return pixels.data() + static_cast<size_t>(y) * static_cast<size_t>(width) * 3; }
  const uint8_t* row(int y) const { return pixels.data() + static_cast<size_t>(y) * static_cast<size_t>(width) * 3; }
};

}  // namespace forge
