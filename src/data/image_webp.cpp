#include "data/image_webp.h"

#include <webp/decode.h>

#include <new>

#include "core/error.h"

namespace forge {
namespace {

uint32_t le32(std::string_view bytes, size_t offset) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = v << 8 | static_cast<unsigned char>(bytes[offset + i]);
  return v;
}

// The payload of the first EXIF chunk of a RIFF/WebP file, or "" when it has none.
std::string exif_chunk(std::string_view bytes) {
  size_t pos = 12;  // after "RIFF" <size> "WEBP"
  while (pos + 8 <= bytes.size()) {
    const std::string_view fourcc = bytes.substr(pos, 4);
    const size_t size = le32(bytes, pos + 4);
    if (size > bytes.size() - pos - 8) return {};
    if (fourcc == "EXIF") return std::string(bytes.substr(pos + 8, size));
    pos += 8 + size + (size & 1);
  }
  return {};
}

[[noreturn]] void fail(VP8StatusCode status, const std::string& name) {
  switch (status) {
    case VP8_STATUS_NOT_ENOUGH_DATA: FORGE_FAIL("{}: truncated WebP: the file ends before the image data does", name);
    case VP8_STATUS_UNSUPPORTED_FEATURE:
      FORGE_FAIL("{}: unsupported WebP: libwebp does not support a feature it uses", name);
    case VP8_STATUS_OUT_OF_MEMORY: throw std::bad_alloc();
    default:
      FORGE_FAIL("{}: corrupt WebP: libwebp reports {}", name,
                 status == VP8_STATUS_BITSTREAM_ERROR ? "a bitstream error" : "an invalid parameter");
  }
}

WebPBitstreamFeatures checked_features(std::string_view bytes, const std::string& name) {
  const size_t riff_size = le32(bytes, 4);  // sniff_image_format saw "RIFF" <size> "WEBP"
  if (riff_size > bytes.size() - 8)
    FORGE_FAIL("{}: truncated WebP: its RIFF header says {} bytes follow, the file has {}", name, riff_size,
               bytes.size() - 8);
  WebPBitstreamFeatures features;
  const VP8StatusCode status = WebPGetFeatures(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &features);
  if (status != VP8_STATUS_OK) fail(status, name);
  if (features.has_animation)
    FORGE_FAIL("{}: unsupported WebP: an animation (forge reads still images; convert the frame to PNG)", name);
  check_image_dimensions(name, "WebP", features.width, features.height);
  return features;
}

}  // namespace

ImageHeader read_webp_header(std::string_view bytes, const std::string& name) {
  const WebPBitstreamFeatures features = checked_features(bytes, name);
  return {features.width, features.height, exif_chunk(bytes)};
}

DecodedImage decode_webp(std::string_view bytes, const std::string& name) {
  const WebPBitstreamFeatures features = checked_features(bytes, name);
  DecodedImage out;
  out.exif = exif_chunk(bytes);
  out.image = RgbImage(features.width, features.height);
  WebPDecoderConfig config;
  FORGE_CHECK(WebPInitDecoderConfig(&config), "libwebp's decoder version does not match its header");
  config.output.colorspace = MODE_RGB;
  config.output.is_external_memory = 1;
  config.output.u.RGBA.rgba = out.image.pixels.data();
  config.output.u.RGBA.stride = features.width * 3;
  config.output.u.RGBA.size = out.image.pixels.size();
  const VP8StatusCode status = WebPDecode(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &config);
  WebPFreeDecBuffer(&config.output);
  if (status != VP8_STATUS_OK) fail(status, name);
  return out;
}

}  // namespace forge
