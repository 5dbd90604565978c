// Reading image files into upright 8-bit RGB: the entry point of forge's image decoding.
//
// NOTE [Image decoding]
// A file's format comes from its first bytes (NOTE [Image formats]); its decoder turns it
// into 8-bit RGB as Pillow's Image.open(...).convert("RGB") would (NOTE [JPEG decoding],
// NOTE [PNG decoding], NOTE [WebP decoding]); then the EXIF orientation turns it upright
// (NOTE [EXIF orientation]), as diffusers' scripts do with exif_transpose first. Images
// above kMaxImagePixels are refused before their pixels are allocated. Every failure is a
// forge::Error that names the file and says what is wrong: not an image (and what it is
// instead), an unsupported variant, a truncated file, corrupt data.
// Files are memory-mapped, so reading a header (read_image_info) touches only the pages
// that hold it.
#pragma once

#include <string>
#include <string_view>

#include "data/image_format.h"
#include "data/image_rgb.h"

namespace forge {

struct ImageInfo {
  ImageFormat format = ImageFormat::Png;
  int stored_width = 0, stored_height = 0;  // as the file stores the pixels
  int orientation = 1;                      // EXIF orientation, 1-8

  // The upright image's size, after the orientation.
  int width() const { return orientation >= 5 ? stored_height : stored_width; }
  int height() const { return orientation >= 5 ? stored_width : stored_height; }
};

// The format, size and orientation of the image in `bytes` (file `name`), from its header.
ImageInfo probe_image(std::string_view bytes, const std::string& name);
ImageInfo read_image_info(const std::string& path);

// The upright 8-bit RGB pixels of the image in `bytes` (file `name`).
RgbImage decode_image(std::string_view bytes, const std::string& name);
RgbImage read_image(const std::string& path);

}  // namespace forge
