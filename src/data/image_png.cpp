#include "data/image_png.h"

#include <png.h>

#include <cstdio>
#include <cstring>
#include <new>
#include <vector>

#include "core/durable_file.h"
#include "core/error.h"

namespace forge {
namespace {

// The state libpng's callbacks share with the reader; plain data only (NOTE [PNG decoding]:
// the error handler jumps over every frame between it and the setjmp).
struct Context {
  const uint8_t* data = nullptr;
  size_t size = 0, pos = 0;
  bool truncated = false;
  std::string* output = nullptr;  // encoding: the bytes written so far
  bool out_of_memory = false;
  char message[256] = {};
};

void on_error(png_structp png, png_const_charp message) {
  auto* context = static_cast<Context*>(png_get_error_ptr(png));
  std::snprintf(context->message, sizeof(context->message), "%s", message);
  png_longjmp(png, 1);
}

void on_warning(png_structp, png_const_charp) {}

void read_from_memory(png_structp png, png_bytep out, size_t n) {
  auto* context = static_cast<Context*>(png_get_io_ptr(png));
  if (n > context->size - context->pos) {
    context->truncated = true;
    png_error(png, "truncated");
  }
  std::memcpy(out, context->data + context->pos, n);
  context->pos += n;
}

void write_to_string(png_structp png, png_bytep data, size_t n) {
  auto* context = static_cast<Context*>(png_get_io_ptr(png));
  try {
    context->output->append(reinterpret_cast<const char*>(data), n);
  } catch (const std::bad_alloc&) {
    context->out_of_memory = true;
    png_error(png, "out of memory");
  }
}

void flush_nothing(png_structp) {}

class PngReader {
 public:
  PngReader(std::string_view bytes) {
    context_.data = reinterpret_cast<const uint8_t*>(bytes.data());
    context_.size = bytes.size();
    png_ = png_create_read_struct(PNG_LIBPNG_VER_STRING, &context_, on_error, on_warning);
    if (png_ != nullptr) info_ = png_create_info_struct(png_);
    if (png_ == nullptr || info_ == nullptr) throw std::bad_alloc();
  }
  ~PngReader() { png_destroy_read_struct(&png_, &info_, nullptr); }
  PngReader(const PngReader&) = delete;
  PngReader& operator=(const PngReader&) = delete;

  // Reads the chunks up to the image data and sets up the conversion to 8-bit RGB.
  bool read_info() {
    if (setjmp(png_jmpbuf(png_))) return false;
    png_set_read_fn(png_, &context_, read_from_memory);
    png_read_info(png_, info_);
    const int bit_depth = png_get_bit_depth(png_, info_), color_type = png_get_color_type(png_, info_);
    if (bit_depth == 16) png_set_strip_16(png_);
    if (color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png_);
    if ((color_type & PNG_COLOR_MASK_COLOR) == 0) {
      if (bit_depth < 8) png_set_expand_gray_1_2_4_to_8(png_);
      png_set_gray_to_rgb(png_);
    }
    // Also drops the alpha that png_set_palette_to_rgb makes of a palette's tRNS.
    png_set_strip_alpha(png_);
    png_set_interlace_handling(png_);
    png_read_update_info(png_, info_);
    return true;
  }

  bool read_rows(png_bytepp rows) {
    if (setjmp(png_jmpbuf(png_))) return false;
    png_read_image(png_, rows);
    return true;
  }

  png_structp png() const { return png_; }
  png_infop info() const { return info_; }
  const Context& context() const { return context_; }

 private:
  Context context_;
  png_structp png_ = nullptr;
  png_infop info_ = nullptr;
};

[[noreturn]] void fail(const PngReader& reader, const std::string& name) {
  const Context& context = reader.context();
  if (context.truncated)
    FORGE_FAIL("{}: truncated PNG: the file ends at byte {} where more data is due", name, context.size);
  FORGE_FAIL("{}: corrupt PNG: {}", name, context.message);
}

std::string exif_of(const PngReader& reader) {
  png_uint_32 size = 0;
  png_bytep exif = nullptr;
  if (png_get_eXIf_1(reader.png(), reader.info(), &size, &exif) == 0 || exif == nullptr) return {};
  return std::string(reinterpret_cast<const char*>(exif), size);
}

void read_checked_info(PngReader& reader, const std::string& name) {
  if (!reader.read_info()) fail(reader, name);
  const png_uint_32 width = png_get_image_width(reader.png(), reader.info());
  const png_uint_32 height = png_get_image_height(reader.png(), reader.info());
  check_image_dimensions(name, "PNG", width, height);
  FORGE_CHECK(png_get_channels(reader.png(), reader.info()) == 3 &&
                  png_get_rowbytes(reader.png(), reader.info()) == static_cast<size_t>(width) * 3,
              "{}: libpng would give {} channels and {} bytes per row of {} pixels", name,
              png_get_channels(reader.png(), reader.info()), png_get_rowbytes(reader.png(), reader.info()), width);
}

}  // namespace

ImageHeader read_png_header(std::string_view bytes, const std::string& name) {
  PngReader reader(bytes);
  read_checked_info(reader, name);
  return {static_cast<int>(png_get_image_width(reader.png(), reader.info())),
          static_cast<int>(png_get_image_height(reader.png(), reader.info())), exif_of(reader)};
}

DecodedImage decode_png(std::string_view bytes, const std::string& name) {
  PngReader reader(bytes);
  read_checked_info(reader, name);
  DecodedImage out;
  out.exif = exif_of(reader);
  out.image = RgbImage(static_cast<int>(png_get_image_width(reader.png(), reader.info())),
                       static_cast<int>(png_get_image_height(reader.png(), reader.info())));
  std::vector<png_bytep> rows(static_cast<size_t>(out.image.height));
  for (int y = 0; y < out.image.height; ++y) rows[y] = out.image.row(y);
  if (!reader.read_rows(rows.data())) fail(reader, name);
  return out;
}

namespace {

class PngWriter {
 public:
  explicit PngWriter(std::string* output) {
    context_.output = output;
    png_ = png_create_write_struct(PNG_LIBPNG_VER_STRING, &context_, on_error, on_warning);
    if (png_ != nullptr) info_ = png_create_info_struct(png_);
    if (png_ == nullptr || info_ == nullptr) throw std::bad_alloc();
  }
  ~PngWriter() { png_destroy_write_struct(&png_, &info_); }
  PngWriter(const PngWriter&) = delete;
  PngWriter& operator=(const PngWriter&) = delete;

  bool write(int width, int height, png_bytepp rows) {
    if (setjmp(png_jmpbuf(png_))) return false;
    png_set_write_fn(png_, &context_, write_to_string, flush_nothing);
    png_set_IHDR(png_, info_, width, height, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
                 PNG_FILTER_TYPE_DEFAULT);
    png_set_compression_level(png_, 6);
    png_write_info(png_, info_);
    png_write_image(png_, rows);
    png_write_end(png_, nullptr);
    return true;
  }

  const Context& context() const { return context_; }

 private:
  Context context_;
  png_structp png_ = nullptr;
  png_infop info_ = nullptr;
};

}  // namespace

std::string encode_png(const RgbImage& image) {
  FORGE_CHECK(image.width > 0 && image.height > 0 &&
                  image.pixels.size() == static_cast<size_t>(image.width) * static_cast<size_t>(image.height) * 3,
              "encode_png of a {}x{} image holding {} bytes", image.width, image.height, image.pixels.size());
  std::string bytes;
  std::vector<png_bytep> rows(static_cast<size_t>(image.height));
  for (int y = 0; y < image.height; ++y) rows[y] = const_cast<png_bytep>(image.row(y));
  PngWriter writer(&bytes);
  if (!writer.write(image.width, image.height, rows.data())) {
    if (writer.context().out_of_memory) throw std::bad_alloc();
    FORGE_FAIL("encoding a {}x{} PNG: {}", image.width, image.height, writer.context().message);
  }
  return bytes;
}

void write_png_file(const std::string& path, const RgbImage& image) {
  write_file_atomic(path, encode_png(image), DurableOptions{.sync = false});
}

}  // namespace forge
