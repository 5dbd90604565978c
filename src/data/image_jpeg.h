// JPEG decoding through libjpeg-turbo's libjpeg API, with Pillow's settings.
//
// NOTE [JPEG decoding]
// Pillow decodes JPEG with libjpeg(-turbo) at the library defaults (the accurate integer
// IDCT, fancy upsampling), and so does forge, so that its pixels are Pillow's: identical
// when both use the same libjpeg-turbo release, and within a level or two otherwise
// (releases have changed rounding in the SIMD color conversion and upsampling). Components:
//   1  grayscale, replicated into R, G and B (PIL's "L" then .convert("RGB"));
//   3  YCbCr (or RGB per the Adobe marker), converted by libjpeg;
//   4  CMYK or YCCK, which libjpeg hands over as CMYK; Pillow assumes Adobe's inverted
//      convention for every CMYK JPEG ("CMYK;I") and converts the un-inverted inks with
//      R = (255 - K) - C (255 - K) / 255 (rounded; its cmyk2rgb), and so does forge.
// Other component counts, 12-bit and lossless JPEGs are refused as unsupported.
// libjpeg's default error handler exits the process, so forge installs its own: an error
// jumps (longjmp) out of the library and becomes a forge::Error naming the file. libjpeg
// only warns about a file that ends early (it pads it with gray) or entropy-coded data it
// cannot decode (it fills blocks with gray); forge refuses those ("truncated", "corrupt")
// instead of training on gray blocks. Harmless warnings (stray bytes between markers, an
// unknown JFIF revision, a bad ICC marker) are ignored, as Pillow ignores them. A
// progressive file may have at most 1000 scans (hostile files with millions of empty
// scans take minutes to decode).
#pragma once

#include <string>
#include <string_view>

#include "data/image_codec.h"

namespace forge {

// The size and EXIF block of JPEG `bytes` (file `name`), reading its markers only.
ImageHeader read_jpeg_header(std::string_view bytes, const std::string& name);

// The pixels of JPEG `bytes` as 8-bit RGB, and its EXIF block.
DecodedImage decode_jpeg(std::string_view bytes, const std::string& name);

}  // namespace forge
