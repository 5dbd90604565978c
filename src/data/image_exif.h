// EXIF orientation: how a camera says its pixels must be turned to stand upright.
//
// NOTE [EXIF orientation]
// Cameras store pixels as the sensor read them and record in EXIF tag 0x0112 how to turn
// them (1 upright, 2 mirrored, 3 rotated 180, 4 flipped, 5 transposed, 6 rotated 90
// clockwise, 7 transversed, 8 rotated 90 counter-clockwise). diffusers' fine-tuning
// scripts call PIL.ImageOps.exif_transpose on every image before anything else, so forge
// applies the orientation too: the dimensions a dataset reports, the buckets images go to
// and the pixels are those of the upright image.
// The EXIF block comes from a JPEG's first APP1 "Exif\0\0" segment, a PNG's eXIf chunk
// before the image data, or a WebP's EXIF chunk; it is a TIFF structure (either byte
// order) and the tag is read from its first directory (IFD0). A block that is missing,
// malformed, or holds another value gives 1 (upright), as PIL ignores what it cannot read:
// metadata never makes forge refuse an image. Not read: the XMP tiff:Orientation that PIL
// falls back to when EXIF has no orientation, and a PNG eXIf chunk after the image data
// (PIL reads one only after loading the pixels).
#pragma once

#include <string_view>

#include "data/image_rgb.h"

namespace forge {

// The orientation (1-8) in an EXIF block (with or without the "Exif\0\0" prefix), 1 when
// there is none or it cannot be read.
int exif_orientation(std::string_view exif);

// Whether orientation `o` swaps width and height (5-8).
inline bool orientation_swaps_sides(int o) { return o >= 5 && o <= 8; }

// The upright image: `image` turned as orientation `o` says (PIL's exif_transpose).
RgbImage apply_orientation(const RgbImage& image, int o);

}  // namespace forge
