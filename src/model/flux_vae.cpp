// FluxVae's encoder and decoder walks and its NCHW interface; see flux_vae.h.
#include "model/flux_vae.h"

#include <string>

#include "ops/image_layout.h"
#include "ops/vae_latents.h"

namespace forge {
namespace {

// NOTE [VAE downsample padding] in ops/conv2d.cpp.
constexpr Conv2dShape kDownsample{3, 2, 0, 0, 1, 1};

}  // namespace

FluxVae::FluxVae(const FluxVaeParameters& params)
    : params_(params), pool_(params.device(), params.dtype()) {}

Shape FluxVae::check_image(const Tensor& image, int64_t channels, const char* what) const {
  const int64_t f = config().downsample_factor();
  FORGE_CHECK(image.ndim() == 4 && image.dim(1) == channels,
              "FLUX VAE {}: the image {} must be [B, {}, H, W]", what, shape_str(image.shape()), channels);
  FORGE_CHECK(image.dim(0) > 0 && image.dim(2) > 0 && image.dim(3) > 0 && image.dim(2) % f == 0 &&
                  image.dim(3) % f == 0,
              "FLUX VAE {}: the image is {}x{}; its sides must be positive multiples of {} (the VAE's downsampling)",
              what, image.dim(2), image.dim(3), f);
  return {image.dim(0), image.dim(2), image.dim(3)};
}

FluxVae::Lease FluxVae::encoder_forward(const Tensor& image) {
  const FluxVaeConfig& c = config();
  Lease h = conv("encoder.conv_in", image, Conv2dShape::same(3));
  for (int64_t i = 0; i < c.levels(); ++i) {
    const std::string block = "encoder.down_blocks." + std::to_string(i);
    for (int64_t j = 0; j < c.layers_per_block; ++j) h = resnet(block + ".resnets." + std::to_string(j), *h);
    if (i + 1 < c.levels()) h = conv(block + ".downsamplers.0.conv", *h, kDownsample);
  }
  h = mid_block("encoder.mid_block", *h);
  h = norm("encoder.conv_norm_out", *h, true);
  h = conv("encoder.conv_out", *h, Conv2dShape::same(3));
  if (c.use_quant_conv) h = conv("quant_conv", *h, Conv2dShape::same(1));
  return h;
}

FluxVae::Lease FluxVae::decoder_forward(const Tensor& z) {
  const FluxVaeConfig& c = config();
  Lease h;
  if (c.use_post_quant_conv) {
    h = conv("post_quant_conv", z, Conv2dShape::same(1));
    h = conv("decoder.conv_in", *h, Conv2dShape::same(3));
  } else {
    h = conv("decoder.conv_in", z, Conv2dShape::same(3));
  }
  h = mid_block("decoder.mid_block", *h);
  for (int64_t i = 0; i < c.levels(); ++i) {
    const std::string block = "decoder.up_blocks." + std::to_string(i);
    for (int64_t j = 0; j <= c.layers_per_block; ++j) h = resnet(block + ".resnets." + std::to_string(j), *h);
    if (i + 1 < c.levels()) h = upsample(block + ".upsamplers.0", *h);
  }
  h = norm("decoder.conv_norm_out", *h, true);
  return conv("decoder.conv_out", *h, Conv2dShape::same(3));
}

void FluxVae::encode_moments(const Tensor& moments, const Tensor& image) {
  const FluxVaeConfig& c = config();
  const Shape s = check_image(image, c.in_channels, "encode");
  const int64_t f = c.downsample_factor();
  check_shape(moments, {s[0], 2 * c.latent_channels, s[1] / f, s[2] / f}, "FLUX VAE encode moments");
  Lease x = pool_.take({s[0], s[1], s[2], c.in_channels});
  nhwc_from_nchw(*x, image);
  Lease m = encoder_forward(*x);
  nchw_from_nhwc(moments, *m);
}

void FluxVae::encode(const Tensor& latents, const Tensor& image, const Tensor* noise) {
  const FluxVaeConfig& c = config();
  const Shape s = check_image(image, c.in_channels, "encode");
  const int64_t f = c.downsample_factor();
  check_shape(latents, {s[0], c.latent_channels, s[1] / f, s[2] / f}, "FLUX VAE encode latents");
  Lease x = pool_.take({s[0], s[1], s[2], c.in_channels});
  nhwc_from_nchw(*x, image);
  Lease m = encoder_forward(*x);
  x = Lease();
  vae_latents_from_moments(latents, *m, noise, c.scaling_factor, c.shift_factor);
}

void FluxVae::decode(const Tensor& image, const Tensor& latents) {
  const FluxVaeConfig& c = config();
  const Shape s = check_image(image, c.out_channels, "decode");
  const int64_t f = c.downsample_factor();
  check_shape(latents, {s[0], c.latent_channels, s[1] / f, s[2] / f}, "FLUX VAE decode latents");
  Lease z = pool_.take({s[0], s[1] / f, s[2] / f, c.latent_channels});
  vae_decoder_input(*z, latents, c.scaling_factor, c.shift_factor);
  Lease out = decoder_forward(*z);
  z = Lease();
  nchw_from_nhwc(image, *out);
}

}  // namespace forge
