// The FLUX VAE's ops on the CPU against their formulas in double: the NHWC convolution (3x3
// "same", 1x1, the downsample's stride 2 with bottom/right padding, uneven channel counts),
// GroupNorm with and without SiLU (in place too, and with a mean far from 0), nearest 2x
// upsampling, the NCHW <-> NHWC transposes, the latent scaling from the moments and back;
// and their refusals of mismatched shapes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "expect_error.h"
#include "ops/conv2d.h"
#include "ops/group_norm.h"
#include "ops/image_layout.h"
#include "ops/upsample.h"
#include "ops/vae_latents.h"
#include "ops_testing.h"

namespace forge {
namespace {

using testing::random_tensor;
using testing::relative_error;

// conv2d by its definition: out[b, y, x, o] = bias[o] + sum in[b, y s + dy - top, x s + dx - left, i] w[o, dy, dx, i].
std::vector<double> conv_reference(const Tensor& in, const Tensor& w, const Tensor& bias, const Conv2dShape& s) {
  const Shape out = conv2d_out_shape(in.shape(), w.dim(0), s);
  const int64_t batch = in.dim(0), h = in.dim(1), wd = in.dim(2), ci = in.dim(3), co = w.dim(0), k = s.kernel;
  std::vector<double> r(static_cast<size_t>(shape_numel(out)));
  const float* x = in.data<float>();
  const float* wt = w.data<float>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t y = 0; y < out[1]; ++y)
      for (int64_t xx = 0; xx < out[2]; ++xx)
        for (int64_t o = 0; o < co; ++o) {
          double sum = bias.data<float>()[o];
          for (int64_t dy = 0; dy < k; ++dy)
            for (int64_t dx = 0; dx < k; ++dx) {
              const int64_t iy = y * s.stride + dy - s.pad_top, ix = xx * s.stride + dx - s.pad_left;
              if (iy < 0 || iy >= h || ix < 0 || ix >= wd) continue;
              for (int64_t i = 0; i < ci; ++i)
                sum += static_cast<double>(x[((b * h + iy) * wd + ix) * ci + i]) * wt[((o * k + dy) * k + dx) * ci + i];
            }
          r[static_cast<size_t>(((b * out[1] + y) * out[2] + xx) * co + o)] = sum;
        }
  return r;
}

struct ConvCase {
  Shape in;
  int64_t out_channels;
  Conv2dShape shape;
};

TEST(OpsConv2d, MatchesTheDefinition) {
  Rng rng(11);
  const ConvCase cases[] = {
      {{2, 5, 7, 3}, 8, Conv2dShape::same(3)},   // the image's 3 channels
      {{1, 4, 4, 16}, 3, Conv2dShape::same(3)},  // the decoder's 3 output channels
      {{2, 6, 5, 12}, 20, Conv2dShape::same(1)},
      {{2, 8, 6, 8}, 8, {3, 2, 0, 0, 1, 1}},     // the downsample: 4x3 out
      {{1, 7, 9, 4}, 5, {3, 2, 0, 0, 1, 1}},     // odd sides
      {{1, 3, 3, 2}, 4, {3, 1, 2, 0, 1, 2}},     // padding wider than the kernel's reach on one side
  };
  for (const ConvCase& c : cases) {
    const int64_t k = c.shape.kernel;
    Tensor in = random_tensor(c.in, rng), w = random_tensor({c.out_channels, k, k, c.in[3]}, rng, 0.3);
    Tensor bias = random_tensor({c.out_channels}, rng);
    Tensor out = Tensor::empty(conv2d_out_shape(c.in, c.out_channels, c.shape));
    testing::fill_nan(out);
    conv2d_forward(out, in, w, bias, c.shape);
    EXPECT_LT(relative_error(out, conv_reference(in, w, bias, c.shape)), 1e-6) << shape_str(c.in);
  }
}

TEST(OpsConv2d, DownsampleHalvesEvenSidesAndWithoutBiasAddsNothing) {
  EXPECT_EQ(conv2d_out_shape({2, 16, 24, 8}, 4, {3, 2, 0, 0, 1, 1}), (Shape{2, 8, 12, 4}));
  EXPECT_EQ(conv2d_out_shape({1, 9, 9, 8}, 4, Conv2dShape::same(3)), (Shape{1, 9, 9, 4}));
  Rng rng(12);
  Tensor in = random_tensor({1, 4, 4, 6}, rng), w = random_tensor({5, 3, 3, 6}, rng);
  Tensor zero_bias = Tensor::zeros({5}), with = Tensor::empty({1, 4, 4, 5}), without = Tensor::empty({1, 4, 4, 5});
  conv2d_forward(with, in, w, zero_bias, Conv2dShape::same(3));
  conv2d_forward(without, in, w, Tensor(), Conv2dShape::same(3));
  EXPECT_EQ(testing::to_double(with), testing::to_double(without));
}

TEST(OpsConv2d, RefusesMismatchedShapes) {
  Tensor in = Tensor::zeros({1, 4, 4, 6}), w = Tensor::zeros({5, 3, 3, 6}), bias = Tensor::zeros({5});
  expect_error([&] { conv2d_forward(Tensor::zeros({1, 4, 4, 4}), in, w, bias, Conv2dShape::same(3)); },
               {"conv2d_forward out"});
  expect_error([&] { conv2d_forward(Tensor::zeros({1, 4, 4, 5}), in, Tensor::zeros({5, 3, 3, 4}), bias,
                                    Conv2dShape::same(3)); },
               {"conv2d_forward weight"});
  expect_error([&] { conv2d_forward(Tensor::zeros({1, 4, 4, 5}), in, w, Tensor::zeros({4}), Conv2dShape::same(3)); },
               {"conv2d_forward bias"});
  expect_error([&] { conv2d_out_shape({1, 2, 2, 6}, 5, {5, 1, 0, 0, 0, 0}); }, {"does not fit"});
  expect_error([&] { conv2d_out_shape({1, 4, 4, 6}, 5, {3, 1, -1, 1, 1, 1}); }, {"negative"});
  expect_error([&] { conv2d_forward(in, in, Tensor::zeros({6, 1, 1, 6}), Tensor(), Conv2dShape::same(1)); },
               {"alias"});
}

// GroupNorm by its definition, in double.
std::vector<double> group_norm_reference(const Tensor& in, const Tensor& weight, const Tensor& bias, int64_t groups,
                                         double eps, bool silu) {
  const int64_t batch = in.dim(0), channels = in.dim(-1), pixels = in.numel() / (batch * channels);
  const int64_t width = channels / groups;
  const float* x = in.data<float>();
  std::vector<double> r(static_cast<size_t>(in.numel()));
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t g = 0; g < groups; ++g) {
      double sum = 0, squares = 0;
      for (int64_t p = 0; p < pixels; ++p)
        for (int64_t c = g * width; c < (g + 1) * width; ++c) sum += x[(b * pixels + p) * channels + c];
      const double mean = sum / static_cast<double>(pixels * width);
      for (int64_t p = 0; p < pixels; ++p)
        for (int64_t c = g * width; c < (g + 1) * width; ++c) {
          const double d = x[(b * pixels + p) * channels + c] - mean;
          squares += d * d;
        }
      const double rstd = 1.0 / std::sqrt(squares / static_cast<double>(pixels * width) + eps);
      for (int64_t p = 0; p < pixels; ++p)
        for (int64_t c = g * width; c < (g + 1) * width; ++c) {
          const int64_t i = (b * pixels + p) * channels + c;
          const double y = (x[i] - mean) * rstd * weight.data<float>()[c] + bias.data<float>()[c];
          r[static_cast<size_t>(i)] = silu ? y / (1.0 + std::exp(-y)) : y;
        }
    }
  return r;
}

TEST(OpsGroupNorm, MatchesTheDefinitionWithAndWithoutSilu) {
  Rng rng(21);
  const std::pair<Shape, int64_t> cases[] = {
      {{2, 3, 5, 8}, 4}, {{1, 4, 4, 32}, 32}, {{3, 7, 12}, 1}, {{2, 1, 1, 6}, 3}};
  for (const auto& [shape, groups] : cases)
    for (bool silu : {false, true}) {
      Tensor in = random_tensor(shape, rng, 2.0);
      for (int64_t i = 0; i < in.numel(); ++i) in.data<float>()[i] += 30.0f;  // a mean far from 0
      Tensor weight = random_tensor({shape.back()}, rng), bias = random_tensor({shape.back()}, rng);
      Tensor out = Tensor::empty(shape);
      testing::fill_nan(out);
      group_norm_forward(out, in, weight, bias, {groups, 1e-6f, silu});
      const std::vector<double> want = group_norm_reference(in, weight, bias, groups, 1e-6, silu);
      EXPECT_LT(relative_error(out, want), 1e-5) << shape_str(shape) << " silu " << silu;
      group_norm_forward(in, in, weight, bias, {groups, 1e-6f, silu});  // in place
      EXPECT_EQ(testing::to_double(in), testing::to_double(out));
    }
}

TEST(OpsGroupNorm, EpsKeepsAConstantGroupFinite) {
  Tensor in = Tensor::zeros({1, 2, 2, 4}), weight = Tensor::zeros({4}), bias = Tensor::zeros({4});
  for (int64_t i = 0; i < 4; ++i) {
    weight.data<float>()[i] = 1.0f;
    bias.data<float>()[i] = static_cast<float>(i);
  }
  Tensor out = Tensor::empty(in.shape());
  group_norm_forward(out, in, weight, bias, {2, 1e-6f, false});
  for (int64_t i = 0; i < out.numel(); ++i) EXPECT_EQ(out.data<float>()[i], static_cast<float>(i % 4));
}

TEST(OpsGroupNorm, RefusesGroupsThatDoNotSplitTheChannels) {
  Tensor in = Tensor::zeros({1, 2, 2, 6}), out = Tensor::zeros({1, 2, 2, 6}), v = Tensor::zeros({6});
  expect_error([&] { group_norm_forward(out, in, v, v, {4, 1e-6f, false}); }, {"6 channels", "4 groups"});
  expect_error([&] { group_norm_forward(out, in, Tensor::zeros({5}), v, {3, 1e-6f, false}); },
               {"group_norm_forward weight"});
  expect_error([&] { group_norm_forward(Tensor::zeros({1, 2, 6}), in, v, v, {3, 1e-6f, false}); },
               {"group_norm_forward out"});
  expect_error([&] { group_norm_forward(out, in, v, v, {3, 0.0f, false}); }, {"eps"});
}

TEST(OpsUpsample, RepeatsEachPixelTwoByTwo) {
  Rng rng(31);
  Tensor in = random_tensor({2, 3, 5, 7}, rng), out = Tensor::empty({2, 6, 10, 7});
  testing::fill_nan(out);
  upsample_nearest2x(out, in);
  std::vector<double> want;
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t y = 0; y < 6; ++y)
      for (int64_t x = 0; x < 10; ++x)
        for (int64_t c = 0; c < 7; ++c) want.push_back(in.data<float>()[((b * 3 + y / 2) * 5 + x / 2) * 7 + c]);
  EXPECT_EQ(testing::to_double(out), want);
  expect_error([&] { upsample_nearest2x(Tensor::zeros({2, 6, 9, 7}), in); }, {"upsample_nearest2x out"});
}

TEST(OpsImageLayout, TransposesBetweenNchwAndNhwc) {
  Rng rng(41);
  Tensor nchw = random_tensor({2, 3, 4, 5}, rng), nhwc = Tensor::empty({2, 4, 5, 3});
  Tensor back = Tensor::empty({2, 3, 4, 5});
  nhwc_from_nchw(nhwc, nchw);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t c = 0; c < 3; ++c)
      for (int64_t y = 0; y < 4; ++y)
        for (int64_t x = 0; x < 5; ++x)
          ASSERT_EQ(nhwc.data<float>()[((b * 4 + y) * 5 + x) * 3 + c],
                    nchw.data<float>()[((b * 3 + c) * 4 + y) * 5 + x]);
  nchw_from_nhwc(back, nhwc);
  EXPECT_EQ(testing::to_double(back), testing::to_double(nchw));
  expect_error([&] { nhwc_from_nchw(Tensor::zeros({2, 5, 4, 3}), nchw); }, {"nhwc_from_nchw"});
  expect_error([&] { nchw_from_nhwc(Tensor::zeros({2, 3, 5, 4}), nhwc); }, {"nchw_from_nhwc"});
}

TEST(OpsVaeLatents, ScaleTheModeOrASampleAndInvertTheScaling) {
  Rng rng(51);
  const int64_t batch = 2, channels = 3, h = 2, w = 5, pixels = h * w;
  const float scale = 0.3611f, shift = 0.1159f;
  Tensor moments = random_tensor({batch, h, w, 2 * channels}, rng, 3.0);
  moments.data<float>()[channels] = 80.0f;       // a log-variance above the clamp (20)
  moments.data<float>()[channels + 1] = -90.0f;  // and below it (-30)
  Tensor noise = random_tensor({batch, channels, h, w}, rng);
  Tensor mode = Tensor::empty({batch, channels, h, w}), sample = Tensor::empty({batch, channels, h, w});
  vae_latents_from_moments(mode, moments, nullptr, scale, shift);
  vae_latents_from_moments(sample, moments, &noise, scale, shift);
  std::vector<double> want_mode, want_sample;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t p = 0; p < pixels; ++p) {
        const float* m = moments.data<float>() + (b * pixels + p) * 2 * channels;
        const double logvar = std::clamp<double>(m[channels + c], -30.0, 20.0);
        const double z = m[c] + std::exp(0.5 * logvar) * noise.data<float>()[(b * channels + c) * pixels + p];
        want_mode.push_back((m[c] - shift) * static_cast<double>(scale));
        want_sample.push_back((z - shift) * static_cast<double>(scale));
      }
  EXPECT_LT(relative_error(mode, want_mode), 1e-6);
  EXPECT_LT(relative_error(sample, want_sample), 1e-6);

  Tensor z = Tensor::empty({batch, h, w, channels});
  vae_decoder_input(z, mode, scale, shift);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t c = 0; c < channels; ++c)
      for (int64_t p = 0; p < pixels; ++p)
        EXPECT_NEAR(z.data<float>()[(b * pixels + p) * channels + c],
                    moments.data<float>()[(b * pixels + p) * 2 * channels + c], 1e-5);
  expect_error([&] { vae_latents_from_moments(mode, Tensor::zeros({batch, h, w, channels}), nullptr, scale, shift); },
               {"moments"});
  expect_error([&] { vae_decoder_input(z, mode, 0.0f, shift); }, {"scaling factor"});
  expect_error([&] { vae_latents_from_moments(mode, moments, &z, scale, shift); }, {"noise"});
}

}  // namespace
}  // namespace forge
