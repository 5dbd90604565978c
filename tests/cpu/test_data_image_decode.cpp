// Image decoding (data/image_decode.h and the per-format decoders): format detection by
// content, the PNG writer and reader round trip, EXIF orientation, and the refusal of
// empty, truncated, corrupt and unknown files, each naming the file. Decoding against
// Pillow's pixels (JPEG, PNG of every color type, WebP) is python.test_image_decode_vs_pil.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "data/image_decode.h"
#include "data/image_exif.h"
#include "data/image_format.h"
#include "data/image_png.h"
#include "expect_error.h"
#include "image_testing.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

using namespace std::string_literals;

void write_file(const std::string& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

TEST(ImageFormat, DetectedByContentNotName) {
  EXPECT_EQ(sniff_image_format("\xff\xd8\xff\xe0 rest"s), ImageFormat::Jpeg);
  EXPECT_EQ(sniff_image_format("\x89PNG\r\n\x1a\n...."s), ImageFormat::Png);
  EXPECT_EQ(sniff_image_format("RIFF\x10\0\0\0WEBPVP8 "s), ImageFormat::Webp);
  EXPECT_FALSE(sniff_image_format("RIFF\x10\0\0\0WAVEfmt "s));
  EXPECT_FALSE(sniff_image_format(""));

  TempDir dir;
  const std::string named_jpg = dir.file("really_a_png.jpg");
  write_pattern_png(named_jpg, 5, 4);
  const ImageInfo info = read_image_info(named_jpg);
  EXPECT_EQ(info.format, ImageFormat::Png);
  EXPECT_EQ(info.width(), 5);
  EXPECT_EQ(info.height(), 4);
}

TEST(ImageFormat, RefusalsSayWhatTheFileIs) {
  const auto what = [](const std::string& head) { return error_of([&] { detect_image_format(head, "f.png"); }); };
  EXPECT_NE(what("GIF89a\x01\0\x01\0\0\0\0"s).find("f.png: not a JPEG, PNG or WebP image: a GIF image"),
            std::string::npos);
  EXPECT_NE(what("BM\x36\0\0\0\0\0\0\0\x36\0\0\0"s).find("a BMP image"), std::string::npos);
  EXPECT_NE(what("II*\0\x08\0\0\0\0\0\0\0"s).find("a TIFF image"), std::string::npos);
  const std::string box_size = "\0\0\0\x1c"s;  // an ISO media file's first box: its size, then "ftyp"
  EXPECT_NE(what(box_size + "ftypavif\0\0\0\0"s).find("an AVIF image"), std::string::npos);
  EXPECT_NE(what(box_size + "ftypheic\0\0\0\0"s).find("a HEIF image"), std::string::npos);
  EXPECT_NE(what("version https://git-lfs.github.com/spec/v1\noid sha256:ab"s).find("git lfs pull"), std::string::npos);
  EXPECT_NE(what("<!DOCTYPE html><html><body>404</body></html>"s).find("an HTML page"), std::string::npos);
  EXPECT_NE(what("").find("an empty file"), std::string::npos);
  EXPECT_NE(what("\x89PNG"s).find("a file of 4 bytes, too short for an image"), std::string::npos);
  EXPECT_NE(what("hello, world, not an image"s).find("unknown content starting 68 65 6c 6c 6f 2c 20 77"),
            std::string::npos);
}

TEST(ImagePng, RoundTripIsExact) {
  for (auto [w, h] : {std::pair{1, 1}, {7, 3}, {64, 48}, {3, 200}}) {
    const RgbImage image = pattern_image(w, h, w * 100 + h);
    const RgbImage back = decode_image(encode_png(image), "mem.png");
    EXPECT_EQ(back.width, w);
    EXPECT_EQ(back.height, h);
    EXPECT_EQ(back.pixels, image.pixels);
  }
}

TEST(ImagePng, TruncatedAndCorruptFilesAreNamed) {
  const std::string png = encode_png(pattern_image(40, 30));
  // Cut in the signature, in IHDR, and in the image data.
  for (size_t keep : {size_t{20}, size_t{30}, png.size() / 2, png.size() - 13})
    expect_error([&] { decode_image(png.substr(0, keep), "cut.png"); }, {"cut.png: truncated PNG"});
  std::string bad_crc = png;
  bad_crc[29] ^= 1;  // IHDR's CRC
  expect_error([&] { decode_image(bad_crc, "crc.png"); }, {"crc.png: corrupt PNG:", "CRC"});
  // A header saying 0 x 30 pixels (with its CRC recomputed by hand would be needed for libpng
  // to get that far: it rejects the CRC first, which is what a damaged header looks like).
  std::string zero_width = png;
  zero_width[16] = zero_width[17] = zero_width[18] = zero_width[19] = 0;
  expect_error([&] { decode_image(zero_width, "zero.png"); }, {"zero.png: corrupt PNG"});
}

TEST(ImageJpeg, TruncatedAndCorruptFilesAreNamed) {
  expect_error([] { decode_image("\xff\xd8\xff\xe0\0\x10JFIF\0"s, "cut.jpg"); }, {"cut.jpg: truncated JPEG"});
  expect_error([] { decode_image("\xff\xd8\xff\xd9 bogus bytes"s, "bad.jpg"); }, {"bad.jpg: corrupt JPEG:"});
  expect_error([] { read_image_info("/nonexistent/x.jpg"); }, {"/nonexistent/x.jpg: cannot open"});
}

TEST(ImageWebp, TruncatedAndCorruptFilesAreNamed) {
  expect_error([] { decode_image("RIFF\x40\0\0\0WEBPVP8 \x30\0\0\0"s, "cut.webp"); }, {"cut.webp: truncated WebP"});
  expect_error([] { decode_image("RIFF\x24\0\0\0WEBPVP8 \x18\0\0\0xxxxxxxxxxxxxxxxxxxxxxxx"s, "bad.webp"); },
               {"bad.webp: corrupt WebP"});
}

// A TIFF block with one IFD0 entry: tag 0x0112 of `type` and `value`, either byte order.
std::string exif_block(bool little, uint16_t type, uint32_t value, bool prefix = false) {
  std::string b = little ? "II*\0"s : "MM\0*"s;
  const auto u16 = [&](uint32_t v) {
    little ? b += {char(v & 0xff), char(v >> 8 & 0xff)} : b += {char(v >> 8 & 0xff), char(v & 0xff)};
  };
  const auto u32 = [&](uint32_t v) { little ? (u16(v & 0xffff), u16(v >> 16)) : (u16(v >> 16), u16(v & 0xffff)); };
  u32(8);       // IFD0 offset
  u16(2);       // entries
  u16(0x010f);  // Make, ASCII
  u16(2);
  u32(4);
  b += "abc\0"s;
  u16(0x0112);
  u16(type);
  u32(1);
  if (type == 3) {
    u16(value);
    u16(0);
  } else {
    u32(value);
  }
  u32(0);  // next IFD
  return prefix ? "Exif\0\0"s + b : b;
}

TEST(ImageExif, OrientationFromEitherByteOrderAndType) {
  for (bool little : {true, false})
    for (uint32_t o = 1; o <= 8; ++o) {
      EXPECT_EQ(exif_orientation(exif_block(little, 3, o)), static_cast<int>(o));
      EXPECT_EQ(exif_orientation(exif_block(little, 4, o, true)), static_cast<int>(o));
    }
  EXPECT_EQ(exif_orientation(exif_block(true, 3, 9)), 1);  // out of range
  EXPECT_EQ(exif_orientation(exif_block(true, 5, 6)), 1);  // RATIONAL: not an orientation
  EXPECT_EQ(exif_orientation(""), 1);
  EXPECT_EQ(exif_orientation("Exif\0\0II*\0\xff\xff\0\0"s), 1);  // IFD beyond the block
  // Cut anywhere before the end of the orientation's entry (byte 34: header, count, 2 entries).
  const std::string full = exif_block(true, 3, 6);
  for (size_t keep = 0; keep < full.size(); ++keep)
    EXPECT_EQ(exif_orientation(full.substr(0, keep)), keep < 34 ? 1 : 6) << keep;
}

TEST(ImageExif, OrientationsTurnTheImageUpright) {
  // 3 x 2 pixels whose red channel numbers them: 0 1 2 / 3 4 5.
  RgbImage image(3, 2);
  for (int i = 0; i < 6; ++i) image.pixels[3 * i] = static_cast<uint8_t>(i);
  const auto reds = [](const RgbImage& im) {
    std::vector<int> r;
    for (size_t i = 0; i < im.pixels.size(); i += 3) r.push_back(im.pixels[i]);
    return r;
  };
  // PIL's exif_transpose of the same image, orientation by orientation.
  const std::vector<std::vector<int>> expected = {{},
                                                  {0, 1, 2, 3, 4, 5},
                                                  {2, 1, 0, 5, 4, 3},
                                                  {5, 4, 3, 2, 1, 0},
                                                  {3, 4, 5, 0, 1, 2},
                                                  {0, 3, 1, 4, 2, 5},
                                                  {3, 0, 4, 1, 5, 2},
                                                  {5, 2, 4, 1, 3, 0},
                                                  {2, 5, 1, 4, 0, 3}};
  for (int o = 1; o <= 8; ++o) {
    const RgbImage upright = apply_orientation(image, o);
    EXPECT_EQ(upright.width, orientation_swaps_sides(o) ? 2 : 3) << o;
    EXPECT_EQ(reds(upright), expected[o]) << "orientation " << o;
  }
}

TEST(ImageDecode, LimitsThePixelCountBeforeAllocating) {
  expect_error([] { check_image_dimensions("big.png", "PNG", 20000, 20000); },
               {"big.png: PNG image of 20000x20000 = 400000000 pixels", "178956970"});
  expect_error([] { check_image_dimensions("zero.png", "PNG", 0, 5); }, {"zero.png: corrupt PNG"});
}

}  // namespace
}  // namespace forge
