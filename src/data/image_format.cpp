#include "data/image_format.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>

#include "core/error.h"

namespace forge {
namespace {

bool starts_with(std::string_view text, std::string_view prefix) { return text.substr(0, prefix.size()) == prefix; }

// What a file that is not JPEG, PNG or WebP holds, for the refusal.
std::string describe_other(std::string_view head) {
  using namespace std::string_view_literals;
  if (head.empty()) return "an empty file";
  if (head.size() < 12) return fmt::format("a file of {} bytes, too short for an image", head.size());
  if (starts_with(head, "GIF87a") || starts_with(head, "GIF89a")) return "a GIF image";
  if (starts_with(head, "BM")) return "a BMP image";
  if (starts_with(head, "II*\0"sv) || starts_with(head, "MM\0*"sv)) return "a TIFF image";
  if (starts_with(head, "\xff\x0a"sv) || starts_with(head, "\0\0\0\x0cJXL \x0d\x0a\x87\x0a"sv))
    return "a JPEG XL image";
  if (starts_with(head, "\0\0\0\x0cjP  \x0d\x0a\x87\x0a"sv) || starts_with(head, "\xff\x4f\xff\x51"sv))
    return "a JPEG 2000 image";
  if (head.size() >= 12 && head.substr(4, 4) == "ftyp") {
    const std::string_view brand = head.substr(8, 4);
    if (brand == "avif" || brand == "avis") return "an AVIF image";
    if (brand == "heic" || brand == "heix" || brand == "mif1" || brand == "msf1" || brand == "hevc")
      return "a HEIF image";
    return fmt::format("an ISO media file (brand '{}')", brand);
  }
  if (starts_with(head, "RIFF")) return "a RIFF file that is not WebP";
  if (starts_with(head, "8BPS")) return "a Photoshop document";
  if (starts_with(head, "\0\0\1\0"sv)) return "an ICO icon";
  if (starts_with(head, "qoif")) return "a QOI image";
  if (head.size() >= 2 && head[0] == 'P' && head[1] >= '1' && head[1] <= '7') return "a netpbm image";
  if (starts_with(head, "version https://git-lfs.github.com/spec/"))
    return "a Git LFS pointer, not the image (fetch the files with `git lfs pull`)";
  std::string lower(head.substr(0, 32));
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  const size_t text_start = lower.find_first_not_of(" \t\r\n\xef\xbb\xbf");
  const std::string_view text = text_start == std::string::npos ? "" : std::string_view(lower).substr(text_start);
  if (starts_with(text, "<!doctype html") || starts_with(text, "<html")) return "an HTML page";
  if (starts_with(text, "<svg") || starts_with(text, "<?xml")) return "an SVG or other XML document";
  std::string bytes;
  for (size_t i = 0; i < std::min<size_t>(head.size(), 8); ++i)
    bytes += fmt::format("{}{:02x}", i ? " " : "", static_cast<unsigned char>(head[i]));
  return fmt::format("unknown content starting {}", bytes);
}

}  // namespace

std::string_view image_format_name(ImageFormat format) {
  switch (format) {
    case ImageFormat::Jpeg: return "JPEG";
    case ImageFormat::Png: return "PNG";
    case ImageFormat::Webp: return "WebP";
  }
  return "?";
}

std::optional<ImageFormat> sniff_image_format(std::string_view head) {
  using namespace std::string_view_literals;
  if (starts_with(head, "\xff\xd8\xff"sv)) return ImageFormat::Jpeg;
  if (starts_with(head, "\x89PNG\r\n\x1a\n"sv)) return ImageFormat::Png;
  if (head.size() >= 12 && starts_with(head, "RIFF") && head.substr(8, 4) == "WEBP") return ImageFormat::Webp;
  return std::nullopt;
}

ImageFormat detect_image_format(std::string_view head, const std::string& name) {
  if (auto format = sniff_image_format(head)) return *format;
  FORGE_FAIL("{}: not a JPEG, PNG or WebP image: {} (forge reads JPEG, PNG and WebP, told apart by their first bytes)",
             name, describe_other(head));
}

}  // namespace forge
