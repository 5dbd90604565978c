// Telling image files apart by their first bytes, never by their names.
//
// NOTE [Image formats]
// forge decodes three formats, each through its reference library:
//   JPEG  starts FF D8 FF                        libjpeg-turbo (libjpeg API), data/image_jpeg.cpp
//   PNG   starts 89 'P' 'N' 'G' 0D 0A 1A 0A      libpng,                      data/image_png.cpp
//   WebP  starts 'RIFF' <size> 'WEBP'            libwebp,                     data/image_webp.cpp
// A file named .png that holds a JPEG is decoded as the JPEG it is. Other formats are
// recognized only to say what they are in the refusal (GIF, BMP, TIFF, HEIF/AVIF, JPEG XL,
// JPEG 2000, Photoshop, ICO, QOI, netpbm, SVG), as are two files that often stand where an
// image should: a Git LFS pointer (a dataset cloned without `git lfs pull`) and an HTML page
// (a download that got an error page).
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace forge {

enum class ImageFormat { Jpeg, Png, Webp };

std::string_view image_format_name(ImageFormat format);  // "JPEG", "PNG", "WebP"

// The format of a file that starts with `head` (its first bytes: 32 are enough), or
// nothing when it is none of the three.
std::optional<ImageFormat> sniff_image_format(std::string_view head);

// The format of file `name` whose first bytes are `head`; throws a forge::Error naming the
// file and what it holds instead ("a GIF image", "a Git LFS pointer", "an empty file",
// "unknown content starting 3c 21 2d 2d") when it is not JPEG, PNG or WebP.
ImageFormat detect_image_format(std::string_view head, const std::string& name);

}  // namespace forge
