// FluxLatentDecoder: see flux_latent_decoder.h.
#include "train/flux_latent_decoder.h"

#include "ckpt/flux_vae_weights.h"
#include "core/error.h"
#include "model/flux_vae.h"
#include "model/pixel_latents.h"
#include "ops/convert.h"

namespace forge {

FluxLatentDecoder::FluxLatentDecoder(const std::string& vae, Device device) : device_(device) {
  if (vae == "pixels") {
    factor_ = kPixelLatentFactor;
    latent_channels_ = kPixelLatentChannels;
    description_ = "pixels";
    return;
  }
  const FluxVaeConfig config = flux_vae_config_at(vae);
  if (!(config.out_channels == 3))
    FORGE_FAIL("{}: the VAE decodes {} channels; an RGB image needs 3", vae, config.out_channels);
  params_ = load_flux_vae(vae, config, device);
  vae_ = std::make_unique<FluxVae>(*params_);
  factor_ = config.downsample_factor();
  latent_channels_ = config.latent_channels;
  description_ = "the VAE at " + vae;
}

FluxLatentDecoder::~FluxLatentDecoder() = default;

void FluxLatentDecoder::decode(const Tensor& image, const Tensor& latents) {
  if (!(latents.device() == Device::CPU && latents.dtype() == DType::F32 && latents.ndim() == 4 &&
        latents.dim(1) == latent_channels_))
    FORGE_FAIL("FLUX decode: latents must be fp32 [B, {}, h, w] on the CPU, got {}", latent_channels_,
               shape_str(latents.shape()));
  if (!(image.device() == Device::CPU && image.dtype() == DType::F32 &&
        image.shape() == Shape({latents.dim(0), 3, latents.dim(2) * factor_, latents.dim(3) * factor_})))
    FORGE_FAIL("FLUX decode: the image must be fp32 [B, 3, h {}, w {}] on the CPU for latents {}, got {}", factor_,
               factor_, shape_str(latents.shape()), shape_str(image.shape()));
  if (!vae_) {
    pixel_latents_decode(image, latents);
    return;
  }
  if (device_ == Device::CPU) {
    vae_->decode(image, latents);
    return;
  }
  const Tensor on_device = latents.to(device_);
  const Tensor decoded = Tensor::empty(image.shape(), params_->dtype(), device_);
  vae_->decode(decoded, on_device);
  copy_converted(image, decoded);
}

}  // namespace forge
