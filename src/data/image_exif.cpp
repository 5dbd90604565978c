#include "data/image_exif.h"

#include <cstdint>
#include <cstring>

namespace forge {
namespace {

class TiffReader {
 public:
  TiffReader(std::string_view bytes, bool little_endian) : bytes_(bytes), little_(little_endian) {}
  bool has(size_t offset, size_t n) const { return offset <= bytes_.size() && n <= bytes_.size() - offset; }
  uint32_t u16(size_t offset) const {
    return little_ ? byte(offset) | byte(offset + 1) << 8 : byte(offset) << 8 | byte(offset + 1);
  }
  uint32_t u32(size_t offset) const {
    return little_ ? u16(offset) | u16(offset + 2) << 16 : u16(offset) << 16 | u16(offset + 2);
  }

 private:
  uint32_t byte(size_t offset) const { return static_cast<unsigned char>(bytes_[offset]); }
  std::string_view bytes_;
  bool little_;
};

}  // namespace

int exif_orientation(std::string_view exif) {
  using namespace std::string_view_literals;
  if (exif.substr(0, 6) == "Exif\0\0"sv) exif.remove_prefix(6);
  if (exif.size() < 8) return 1;
  bool little;
  if (exif.substr(0, 4) == "II*\0"sv) {
    little = true;
  } else if (exif.substr(0, 4) == "MM\0*"sv) {
    little = false;
  } else {
    return 1;
  }
  const TiffReader tiff(exif, little);
  const size_t ifd = tiff.u32(4);
  if (!tiff.has(ifd, 2)) return 1;
  const size_t entries = tiff.u16(ifd);
  for (size_t i = 0; i < entries; ++i) {
    const size_t entry = ifd + 2 + 12 * i;
    if (!tiff.has(entry, 12)) return 1;
    if (tiff.u16(entry) != 0x0112) continue;
    const uint32_t type = tiff.u16(entry + 2), count = tiff.u32(entry + 4);
    if (count != 1) return 1;
    uint32_t value;
    if (type == 3) {  // SHORT, in the first two bytes of the value field
      value = tiff.u16(entry + 8);
    } else if (type == 4) {  // LONG, which some writers use
      value = tiff.u32(entry + 8);
    } else {
      return 1;
    }
    return value >= 1 && value <= 8 ? static_cast<int>(value) : 1;
  }
  return 1;
}

RgbImage apply_orientation(const RgbImage& image, int o) {
  if (o < 2 || o > 8) return image;
  // Output pixel (x, y) reads stored pixel (sx, sy): (x, y), or (y, x) when the orientation
  // transposes, then mirrored in x and/or y. PIL's methods: 2 FLIP_LEFT_RIGHT, 3 ROTATE_180,
  // 4 FLIP_TOP_BOTTOM, 5 TRANSPOSE, 6 ROTATE_270, 7 TRANSVERSE, 8 ROTATE_90.
  struct Turn {
    bool transpose, mirror_x, mirror_y;
  };
  static constexpr Turn kTurns[9] = {{},
                                     {false, false, false},
                                     {false, true, false},
                                     {false, true, true},
                                     {false, false, true},
                                     {true, false, false},
                                     {true, false, true},
                                     {true, true, true},
                                     {true, true, false}};
  const Turn turn = kTurns[o];
  const int w = image.width, h = image.height;
  RgbImage out = turn.transpose ? RgbImage(h, w) : RgbImage(w, h);
  for (int y = 0; y < out.height; ++y) {
    uint8_t* dst = out.row(y);
    for (int x = 0; x < out.width; ++x) {
      int sx = turn.transpose ? y : x, sy = turn.transpose ? x : y;
      if (turn.mirror_x) sx = w - 1 - sx;
      if (turn.mirror_y) sy = h - 1 - sy;
      std::memcpy(dst + 3 * static_cast<size_t>(x), image.row(sy) + 3 * static_cast<size_t>(sx), 3);
    }
  }
  return out;
}

}  // namespace forge
