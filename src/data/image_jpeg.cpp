#include "data/image_jpeg.h"

// clang-format off
#include <cstdio>  // jpeglib.h needs FILE declared first
#include <jpeglib.h>
#include <jerror.h>
// clang-format on

#include <csetjmp>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace forge {
namespace {

constexpr int kMaxScans = 1000;  // NOTE [JPEG decoding]

enum class Failure { None, Corrupt, Truncated, Unsupported, TooManyScans };

// libjpeg's error manager with a jump target: error_exit and the warnings forge refuses
// jump back to the setjmp of the call that is under way (NOTE [JPEG decoding]). Every
// function that calls libjpeg sets the target first and holds no C++ object with a
// destructor, so that the jump skips none.
struct ErrorManager {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  Failure failure = Failure::None;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void fail_with(j_common_ptr cinfo, Failure failure) {
  auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
  err->failure = failure;
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

void on_error_exit(j_common_ptr cinfo) {
  switch (cinfo->err->msg_code) {
    case JERR_BAD_PRECISION:
    case JERR_NOT_COMPILED:
    case JERR_CONVERSION_NOTIMPL:
    case JERR_SOF_UNSUPPORTED:
    case JERR_NOTIMPL: fail_with(cinfo, Failure::Unsupported);
    default: fail_with(cinfo, Failure::Corrupt);
  }
}

void on_emit_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  switch (cinfo->err->msg_code) {
    case JWRN_JPEG_EOF: fail_with(cinfo, Failure::Truncated);
    case JWRN_HIT_MARKER:
    case JWRN_HUFF_BAD_CODE:
    case JWRN_ARITH_BAD_CODE:
    case JWRN_MUST_RESYNC:
    case JWRN_NOT_SEQUENTIAL:
    case JWRN_BOGUS_PROGRESSION: fail_with(cinfo, Failure::Corrupt);
    default: cinfo->err->num_warnings++;
  }
}

void on_progress(j_common_ptr cinfo) {
  if (!cinfo->is_decompressor) return;
  if (reinterpret_cast<j_decompress_ptr>(cinfo)->input_scan_number > kMaxScans) {
    auto* err = reinterpret_cast<ErrorManager*>(cinfo->err);
    err->failure = Failure::TooManyScans;
    std::longjmp(err->jump, 1);
  }
}

class JpegReader {
 public:
  JpegReader() {
    std::memset(&cinfo_, 0, sizeof(cinfo_));
    cinfo_.err = jpeg_std_error(&err_.pub);
    err_.pub.error_exit = on_error_exit;
    err_.pub.emit_message = on_emit_message;
    progress_.progress_monitor = on_progress;
  }
  ~JpegReader() {
    if (created_) jpeg_destroy_decompress(&cinfo_);
  }
  JpegReader(const JpegReader&) = delete;
  JpegReader& operator=(const JpegReader&) = delete;

  // Reads the markers up to the first scan and chooses the output color space.
  bool read_header(const uint8_t* data, size_t size) {
    if (setjmp(err_.jump)) return false;
    created_ = true;
    jpeg_create_decompress(&cinfo_);
    cinfo_.progress = &progress_;
    jpeg_mem_src(&cinfo_, data, static_cast<unsigned long>(size));
    jpeg_save_markers(&cinfo_, JPEG_APP0 + 1, 0xFFFF);
    jpeg_read_header(&cinfo_, TRUE);
    if (cinfo_.num_components == 1) {
      cinfo_.out_color_space = JCS_GRAYSCALE;
    } else if (cinfo_.num_components == 3) {
      cinfo_.out_color_space = JCS_RGB;
    } else if (cinfo_.num_components == 4) {
      cinfo_.out_color_space = JCS_CMYK;
    }
    jpeg_calc_output_dimensions(&cinfo_);
    return true;
  }

  // Decodes into `rgb` (width * height * 3 bytes) through `row` (width * components bytes).
  bool read_pixels(uint8_t* rgb, uint8_t* row) {
    if (setjmp(err_.jump)) return false;
    jpeg_start_decompress(&cinfo_);
    const size_t width = cinfo_.output_width;
    const int components = cinfo_.output_components;
    while (cinfo_.output_scanline < cinfo_.output_height) {
      uint8_t* out = rgb + static_cast<size_t>(cinfo_.output_scanline) * width * 3;
      JSAMPROW rows[1] = {components == 3 ? out : row};
      jpeg_read_scanlines(&cinfo_, rows, 1);
      if (components == 1) {
        for (size_t x = 0; x < width; ++x) out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = row[x];
      } else if (components == 4) {
        for (size_t x = 0; x < width; ++x) {
          // Pillow's "CMYK;I" then cmyk2rgb: the inverted stored inks, R = nk - C nk / 255 with nk = 255 - K.
          const int nk = row[4 * x + 3];
          for (int c = 0; c < 3; ++c) {
            const int tmp = (255 - row[4 * x + c]) * nk + 128;
            out[3 * x + c] = static_cast<uint8_t>(nk - (((tmp >> 8) + tmp) >> 8));
          }
        }
      }
    }
    jpeg_finish_decompress(&cinfo_);
    return true;
  }

  jpeg_decompress_struct& cinfo() { return cinfo_; }
  Failure failure() const { return err_.failure; }
  const char* message() const { return err_.message; }

 private:
  jpeg_decompress_struct cinfo_;
  ErrorManager err_;
  jpeg_progress_mgr progress_{};
  bool created_ = false;
};

[[noreturn]] void fail(const JpegReader& reader, const std::string& name) {
  switch (reader.failure()) {
    case Failure::Truncated: FORGE_FAIL("{}: truncated JPEG: the file ends before the image data does", name);
    case Failure::Unsupported:
      FORGE_FAIL("{}: unsupported JPEG: {} (forge reads 8-bit baseline and progressive JPEG)", name, reader.message());
    case Failure::TooManyScans: FORGE_FAIL("{}: corrupt JPEG: more than {} progressive scans", name, kMaxScans);
    case Failure::Corrupt:
    case Failure::None: break;
  }
  FORGE_FAIL("{}: corrupt JPEG: {}", name, reader.message());
}

std::string exif_of(jpeg_decompress_struct& cinfo) {
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m != nullptr; m = m->next) {
    if (m->marker == JPEG_APP0 + 1 && m->data_length >= 6 && std::memcmp(m->data, "Exif\0\0", 6) == 0)
      return std::string(reinterpret_cast<const char*>(m->data), m->data_length);
  }
  return {};
}

// The header, checked: a supported component count and a size within kMaxImagePixels.
void read_checked_header(JpegReader& reader, std::string_view bytes, const std::string& name) {
  if (!reader.read_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size())) fail(reader, name);
  const jpeg_decompress_struct& cinfo = reader.cinfo();
  if (cinfo.num_components != 1 && cinfo.num_components != 3 && cinfo.num_components != 4)
    FORGE_FAIL("{}: unsupported JPEG: {} color components (forge reads 1: gray, 3: color, 4: CMYK)", name,
               cinfo.num_components);
  check_image_dimensions(name, "JPEG", cinfo.image_width, cinfo.image_height);
  FORGE_CHECK(cinfo.output_width == cinfo.image_width && cinfo.output_height == cinfo.image_height &&
                  cinfo.output_components == cinfo.num_components,
              "{}: libjpeg would output {}x{} pixels of {} components for a {}x{} image of {}", name,
              cinfo.output_width, cinfo.output_height, cinfo.output_components, cinfo.image_width, cinfo.image_height,
              cinfo.num_components);
}

}  // namespace

ImageHeader read_jpeg_header(std::string_view bytes, const std::string& name) {
  JpegReader reader;
  read_checked_header(reader, bytes, name);
  return {static_cast<int>(reader.cinfo().image_width), static_cast<int>(reader.cinfo().image_height),
          exif_of(reader.cinfo())};
}

DecodedImage decode_jpeg(std::string_view bytes, const std::string& name) {
  JpegReader reader;
  read_checked_header(reader, bytes, name);
  jpeg_decompress_struct& cinfo = reader.cinfo();
  DecodedImage out;
  out.exif = exif_of(cinfo);
  out.image = RgbImage(static_cast<int>(cinfo.image_width), static_cast<int>(cinfo.image_height));
  std::vector<uint8_t> row(static_cast<size_t>(cinfo.image_width) * 4);
  if (!reader.read_pixels(out.image.pixels.data(), row.data())) fail(reader, name);
  return out;
}

}  // namespace forge
