// Resizing 8-bit RGB images exactly as Pillow's Image.resize(size, Image.BILINEAR) does,
// which is what torchvision's Resize(..., InterpolationMode.BILINEAR) runs on PIL images
// in diffusers' FLUX fine-tuning scripts, or with Image.BICUBIC, Image.resize's default
// filter, which torchtitan's (MLPerf's) Flux.1 data pipeline runs.
//
// NOTE [PIL's bilinear resize]
// Pillow resamples with a separable filter, not by sampling 4 neighbours: when an axis
// shrinks by a factor s > 1, the triangle filter is stretched to a support of s input
// pixels each side (antialiasing). Per axis and output index i (Resample.c's
// precompute_coeffs, in double precision):
//   scale   = in / out;  fs = max(scale, 1);  support = fs
//   center  = (i + 0.5) scale
//   xmin    = max(0, (int)(center - support + 0.5)),  xmax = min(in, (int)(center + support + 0.5))
//   w[x]    = tri((x + xmin - center + 0.5) / fs) for x in [0, xmax - xmin), tri(t) = max(0, 1 - |t|)
//   w       = w / sum(w),  then in fixed point: (int)(0.5 + w 2^22)
// then one pass per axis, each rounding its results to 8 bits (acc = 2^21 + sum w p;
// out = clamp(acc >> 22, 0, 255)), so the order of the passes matters by a level here and
// there: Pillow 13 runs the vertical pass first when the height shrinks by more than twice
// as many pixels as the width (in_h - out_h > 0 and > 2 (in_w - out_w)), the horizontal one
// first otherwise; Pillow 12 and older always ran the horizontal one first. forge follows
// Pillow 13 and repeats the arithmetic step for step, so its output is Pillow 13's byte for
// byte (python.test_image_decode_vs_pil checks it), and within one level of older Pillows'.
// A window of the resized image is computed from the same weights without the rest of it
// (each output pixel depends only on its own row and column weights), which is how a
// bucket's crop is cut from an image resized to cover the bucket without materializing a
// possibly huge resized image.
// Bicubic (Resample.c's bicubic_filter, Keys' cubic with a = -0.5) is the same machinery
// with another kernel and twice the support (2 input pixels each side at scale 1, stretched
// by fs as above), so the same formulas hold with support = 2 fs and tri replaced by
//   cubic(t) = ((a + 2)|t| - (a + 3)) t^2 + 1       for |t| < 1
//              (((|t| - 5)|t| + 8)|t| - 4) a        for 1 <= |t| < 2,   0 beyond
// Its weights can be negative: they round half away from zero, (int)(-0.5 + w 2^22), as in
// Pillow, and the clamp to [0, 255] after each pass then matters (an overshoot at an edge
// is clipped before the second pass reads it). One implementation serves both filters
// (resize_image_window with a ResampleFilter); python.test_image_decode_vs_pil checks the
// bicubic bytes against Pillow 13.0.0's Image.resize(..., BICUBIC) too, both pass orders,
// up and down.
#pragma once

#include "data/image_rgb.h"

namespace forge {

enum class ResampleFilter { Bilinear, Bicubic };

// `image` resized to width x height with `filter` (Pillow's Image.resize).
RgbImage resize_image(const RgbImage& image, int width, int height, ResampleFilter filter);

// The window of crop_width x crop_height pixels at (left, top) of resize_image(image,
// width, height, filter), computed without the rest; the window lies inside width x height.
RgbImage resize_image_window(const RgbImage& image, int width, int height, int left, int top, int crop_width,
                             int crop_height, ResampleFilter filter);

// `image` resized to width x height (Pillow's Image.resize with BILINEAR).
RgbImage resize_bilinear(const RgbImage& image, int width, int height);

// The window of crop_width x crop_height pixels at (left, top) of resize_bilinear(image,
// width, height), computed without the rest; the window lies inside width x height.
RgbImage resize_bilinear_window(const RgbImage& image, int width, int height, int left, int top, int crop_width,
                                int crop_height);

}  // namespace forge
