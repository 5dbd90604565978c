#include "data/image_resize.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/error.h"

namespace forge {
namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // Pillow's PRECISION_BITS

// The fixed-point filter weights of output indices [begin, begin + n) of an axis resized
// from in_size to out_size with `filter` (NOTE [PIL's bilinear resize]).
struct AxisWeights {
  int ksize = 0;
  std::vector<int> first, count;  // per output index: its first input index and number of taps
  std::vector<int32_t> weights;   // per output index: ksize weights, the first `count` used
};

// Resample.c's bilinear_filter and bicubic_filter (a = -0.5), in the same double arithmetic.
double triangle(double x) {
  if (x < 0.0) x = -x;
  return x < 1.0 ? 1.0 - x : 0.0;
}

double cubic(double x) {
  constexpr double a = -0.5;
  if (x < 0.0) x = -x;
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

// The filter's support at scale 1: 1 input pixel each side for bilinear, 2 for bicubic.
double filter_support(ResampleFilter filter) { return filter == ResampleFilter::Bicubic ? 2.0 : 1.0; }

double filter_value(ResampleFilter filter, double x) {
  return filter == ResampleFilter::Bicubic ? cubic(x) : triangle(x);
}

AxisWeights axis_weights(ResampleFilter filter, int in_size, int out_size, int begin, int n) {
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = filter_support(filter) * filterscale;
  const double inv_filterscale = 1.0 / filterscale;
  AxisWeights axis;
  axis.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  axis.first.resize(n);
  axis.count.resize(n);
  axis.weights.assign(static_cast<size_t>(n) * axis.ksize, 0);
  std::vector<double> k(axis.ksize);
  for (int i = 0; i < n; ++i) {
    const int xx = begin + i;
    const double center = 0.0 + (xx + 0.5) * scale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    FORGE_CHECK(xmax >= 1 && xmax <= axis.ksize, "{} taps for output {} of {} -> {}", xmax, xx, in_size, out_size);
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      k[x] = filter_value(filter, (x + xmin - center + 0.5) * inv_filterscale);
      ww += k[x];
    }
    for (int x = 0; x < xmax; ++x) {
      const double w = ww != 0.0 ? k[x] / ww : k[x];
      axis.weights[static_cast<size_t>(i) * axis.ksize + x] =
          static_cast<int32_t>(w < 0 ? -0.5 + w * (1 << kPrecisionBits) : 0.5 + w * (1 << kPrecisionBits));
    }
    axis.first[i] = xmin;
    axis.count[i] = xmax;
  }
  return axis;
}

uint8_t clip8(int32_t acc) {
  const int32_t v = acc >> kPrecisionBits;
  return static_cast<uint8_t>(v < 0 ? 0 : v > 255 ? 255 : v);
}

// out(x, y) from the taps of columns.first[x] - column_offset on row y + row_offset of `in`.
void horizontal_pass(const RgbImage& in, int row_offset, int column_offset, const AxisWeights& columns, RgbImage& out) {
  for (int y = 0; y < out.height; ++y) {
    const uint8_t* row = in.row(y + row_offset);
    uint8_t* dst = out.row(y);
    for (int x = 0; x < out.width; ++x) {
      const int32_t* k = &columns.weights[static_cast<size_t>(x) * columns.ksize];
      const uint8_t* p = row + 3 * static_cast<size_t>(columns.first[x] - column_offset);
      int32_t r = 1 << (kPrecisionBits - 1), g = r, b = r;
      for (int t = 0; t < columns.count[x]; ++t, p += 3) {
        r += p[0] * k[t];
        g += p[1] * k[t];
        b += p[2] * k[t];
      }
      dst[3 * x] = clip8(r);
      dst[3 * x + 1] = clip8(g);
      dst[3 * x + 2] = clip8(b);
    }
  }
}

// out(x, y) from the taps of rows.first[y] - row_offset on column x + column_offset of `in`.
void vertical_pass(const RgbImage& in, int row_offset, int column_offset, const AxisWeights& rows, RgbImage& out) {
  const size_t stride = static_cast<size_t>(out.width) * 3;
  std::vector<int32_t> acc(stride);
  for (int y = 0; y < out.height; ++y) {
    const int32_t* k = &rows.weights[static_cast<size_t>(y) * rows.ksize];
    std::fill(acc.begin(), acc.end(), 1 << (kPrecisionBits - 1));
    for (int t = 0; t < rows.count[y]; ++t) {
      const uint8_t* src = in.row(rows.first[y] - row_offset + t) + 3 * static_cast<size_t>(column_offset);
      for (size_t i = 0; i < stride; ++i) acc[i] += src[i] * k[t];
    }
    uint8_t* dst = out.row(y);
    for (size_t i = 0; i < stride; ++i) dst[i] = clip8(acc[i]);
  }
}

}  // namespace

RgbImage resize_image_window(const RgbImage& image, int width, int height, int left, int top, int crop_width,
                             int crop_height, ResampleFilter filter) {
  FORGE_CHECK(image.width > 0 && image.height > 0 && width > 0 && height > 0, "resize of {}x{} to {}x{}", image.width,
              image.height, width, height);
  FORGE_CHECK(left >= 0 && top >= 0 && crop_width > 0 && crop_height > 0 && left <= width - crop_width &&
                  top <= height - crop_height,
              "window {}x{} at ({}, {}) outside {}x{}", crop_width, crop_height, left, top, width, height);
  const AxisWeights columns = axis_weights(filter, image.width, width, left, crop_width);
  const AxisWeights rows = axis_weights(filter, image.height, height, top, crop_height);
  RgbImage result(crop_width, crop_height);
  // Pillow 13 runs the vertical pass first when the height shrinks by more than twice as
  // many pixels as the width (NOTE [PIL's bilinear resize]).
  const int64_t shrink_y = static_cast<int64_t>(image.height) - height,
                shrink_x = static_cast<int64_t>(image.width) - width;
  if (shrink_y > 0 && shrink_y > shrink_x * 2) {
    // Only the input columns the window's output columns read.
    const int column_begin = columns.first.front();
    const int column_end = columns.first.back() + columns.count.back();
    RgbImage tall(column_end - column_begin, crop_height);
    vertical_pass(image, 0, column_begin, rows, tall);
    horizontal_pass(tall, 0, column_begin, columns, result);
  } else {
    // Only the input rows the window's output rows read.
    const int row_begin = rows.first.front();
    const int row_end = rows.first.back() + rows.count.back();
    RgbImage wide(crop_width, row_end - row_begin);
    horizontal_pass(image, row_begin, 0, columns, wide);
    vertical_pass(wide, row_begin, 0, rows, result);
  }
  return result;
}

RgbImage resize_image(const RgbImage& image, int width, int height, ResampleFilter filter) {
  return resize_image_window(image, width, height, 0, 0, width, height, filter);
}

RgbImage resize_bilinear_window(const RgbImage& image, int width, int height, int left, int top, int crop_width,
                                int crop_height) {
  return resize_image_window(image, width, height, left, top, crop_width, crop_height, ResampleFilter::Bilinear);
}

RgbImage resize_bilinear(const RgbImage& image, int width, int height) {
  return resize_image(image, width, height, ResampleFilter::Bilinear);
}

}  // namespace forge
