// WebP decoding through libwebp.
//
// NOTE [WebP decoding]
// Lossy (VP8) and lossless (VP8L) still images, with or without alpha, decoded by
// libwebp straight to RGB: alpha is dropped, as Pillow's convert("RGB") of the "RGBA" image
// it opens drops it. Lossless pixels are exact; lossy ones are what libwebp's decoder
// makes of the VP8 data, identical across releases in practice (the Python test compares
// with Pillow's bundled libwebp within a small tolerance). An animated WebP is refused as
// unsupported (Pillow would give its first frame; forge reads still images only). The
// EXIF chunk of the extended format (VP8X) is read for NOTE [EXIF orientation]. libwebp
// reports errors by status code: NOT_ENOUGH_DATA is "truncated", BITSTREAM_ERROR "corrupt",
// UNSUPPORTED_FEATURE "unsupported".
#pragma once

#include <string>
#include <string_view>

#include "data/image_codec.h"

namespace forge {

// The size and EXIF block of WebP `bytes` (file `name`), from its headers.
ImageHeader read_webp_header(std::string_view bytes, const std::string& name);

// The pixels of WebP `bytes` as 8-bit RGB (alpha dropped), and its EXIF block.
DecodedImage decode_webp(std::string_view bytes, const std::string& name);

}  // namespace forge
