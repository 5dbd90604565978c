// PNG decoding and encoding through libpng.
//
// NOTE [PNG decoding]
// Every PNG comes out as 8-bit RGB, converted as Pillow's Image.convert("RGB") converts
// what Image.open gives, so that forge sees the pixels diffusers' scripts see:
//   - gray (1, 2, 4, 8 bits) is scaled to 0-255 (v * 255, 85 or 17) and replicated into R, G, B;
//   - a palette is looked up; its transparency (tRNS) is ignored, as is a tRNS color of a
//     gray or RGB image: convert("RGB") drops transparency without compositing;
//   - an alpha channel (gray+alpha, RGBA) is dropped, not composited onto a background:
//     convert("RGB") of "LA" and "RGBA" keeps the color channels as stored;
//   - 16-bit samples keep their high byte (Pillow's "RGB;16B", "RGBA;16B", "LA;16B"). One
//     deliberate difference: Pillow opens 16-bit gray as mode "I;16", whose convert("RGB")
//     clips every value above 255 to white (mostly white images); forge takes the high
//     byte there too, like every other 16-bit image;
//   - interlaced (Adam7) images are deinterlaced; gamma (gAMA), ICC profiles and sBIT are
//     ignored, as Pillow ignores them;
//   - an animated PNG gives its default image, as Pillow's first frame.
// libpng reports errors by calling a handler that must not return; forge's jumps back
// (setjmp/longjmp) to the call under way and turns the message into a forge::Error naming
// the file: "truncated PNG" when the data ends early, "corrupt PNG: <libpng's message>"
// otherwise (bad CRC of a critical chunk, bad zlib data, missing image data). Warnings
// (bad ancillary chunks, which libpng skips) are ignored.
#pragma once

#include <string>
#include <string_view>

#include "data/image_codec.h"

namespace forge {

// The size and EXIF block (eXIf chunk) of PNG `bytes` (file `name`), reading the chunks
// before the image data only.
ImageHeader read_png_header(std::string_view bytes, const std::string& name);

// The pixels of PNG `bytes` as 8-bit RGB (NOTE [PNG decoding]), and its EXIF block.
DecodedImage decode_png(std::string_view bytes, const std::string& name);

// `image` as an 8-bit RGB, non-interlaced PNG file's bytes (zlib level 6, adaptive filters).
std::string encode_png(const RgbImage& image);

// encode_png(image) into `path`, written atomically (core/durable_file.h, no fsync).
void write_png_file(const std::string& path, const RgbImage& image);

}  // namespace forge
