#include "data/image_decode.h"

#include "core/error.h"
#include "data/image_codec.h"
#include "data/image_exif.h"
#include "data/image_jpeg.h"
#include "data/image_png.h"
#include "data/image_webp.h"
#include "data/mapped_file.h"

namespace forge {

void check_image_dimensions(const std::string& name, std::string_view format, int64_t width, int64_t height) {
  if (width <= 0 || height <= 0)
    FORGE_FAIL("{}: corrupt {}: its header says {}x{} pixels", name, format, width, height);
  if (width * height > kMaxImagePixels)
    FORGE_FAIL("{}: {} image of {}x{} = {} pixels, more than forge decodes ({}, Pillow's decompression-bomb limit)",
               name, format, width, height, width * height, kMaxImagePixels);
}

ImageInfo probe_image(std::string_view bytes, const std::string& name) {
  const ImageFormat format = detect_image_format(bytes.substr(0, 32), name);
  ImageHeader header;
  switch (format) {
    case ImageFormat::Jpeg: header = read_jpeg_header(bytes, name); break;
    case ImageFormat::Png: header = read_png_header(bytes, name); break;
    case ImageFormat::Webp: header = read_webp_header(bytes, name); break;
  }
  return {format, header.width, header.height, exif_orientation(header.exif)};
}

ImageInfo read_image_info(const std::string& path) {
  const MappedFile file(path);
  return probe_image(std::string_view(reinterpret_cast<const char*>(file.data()), file.size()), path);
}

RgbImage decode_image(std::string_view bytes, const std::string& name) {
  const ImageFormat format = detect_image_format(bytes.substr(0, 32), name);
  DecodedImage decoded;
  switch (format) {
    case ImageFormat::Jpeg: decoded = decode_jpeg(bytes, name); break;
    case ImageFormat::Png: decoded = decode_png(bytes, name); break;
    case ImageFormat::Webp: decoded = decode_webp(bytes, name); break;
  }
  const int orientation = exif_orientation(decoded.exif);
  if (orientation == 1) return std::move(decoded.image);
  return apply_orientation(decoded.image, orientation);
}

RgbImage read_image(const std::string& path) {
  const MappedFile file(path);
  return decode_image(std::string_view(reinterpret_cast<const char*>(file.data()), file.size()), path);
}

}  // namespace forge
