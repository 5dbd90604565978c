// FluxVae: FLUX.1's autoencoder (diffusers' AutoencoderKL, NOTE [FLUX VAE architecture] in
// flux_vae_config.h), inference only: the encoder turns images into the latents a FLUX
// transformer trains on (forge prep --images), the decoder turns latents back into images
// (forge sample). Forward passes only, on the CPU reference in fp32 and on CUDA in bf16,
// activations NHWC inside (NOTE [NHWC activations] in ops/conv2d.h).
//
// NOTE [FLUX VAE latents]
// diffusers' FluxPipeline scales the VAE's latent space around the transformer:
//   encode  latents = (z - shift_factor) * scaling_factor
//           z = the latent distribution's mode (its mean), or a sample mean + std * noise
//           with std = exp(0.5 * clamp(logvar, -30, 20)) (diffusers' DiagonalGaussianDistribution)
//   decode  image = decoder(latents / scaling_factor + shift_factor)
// with FLUX's 0.3611 and 0.1159 (vae/config.json). forge's images and latents are NCHW at
// this interface, as diffusers' and ops/patchify.h's are: images [B, C, H, W] with values in
// [-1, 1] (decoded images are not clamped), latents [B, L, H/8, W/8].
#pragma once

#include <string>

#include "core/tensor.h"
#include "model/flux_vae_activations.h"
#include "model/flux_vae_parameters.h"
#include "ops/conv2d.h"

namespace forge {

class FluxVae {
 public:
  // Runs on params' device with its weights; params must outlive the model.
  explicit FluxVae(const FluxVaeParameters& params);

  const FluxVaeConfig& config() const { return params_.config(); }
  Device device() const { return params_.device(); }

  // image [B, in_channels, H, W] (fp32 on the CPU, bf16 on CUDA), H and W positive multiples
  // of config().downsample_factor(). moments [B, 2 L, H/f, W/f] in the image's dtype: the
  // mean (channels [0, L)) and the log-variance ([L, 2L), not clamped): diffusers'
  // latent_dist.parameters.
  void encode_moments(const Tensor& moments, const Tensor& image);
  // latents [B, L, H/f, W/f] (NOTE [FLUX VAE latents]): the mode, or with `noise` (shaped and
  // typed like latents) a sample. fp32 on the CPU; fp32 or bf16 on CUDA.
  void encode(const Tensor& latents, const Tensor& image, const Tensor* noise = nullptr);
  // image [B, out_channels, H, W] from latents [B, L, H/f, W/f] scaled as encode makes them.
  void decode(const Tensor& image, const Tensor& latents);

  // Elements the activation buffers hold now (NOTE [VAE activation pool]).
  int64_t activation_elements() const { return pool_.held_elements(); }

 private:
  using Lease = VaeActivationPool::Lease;

  // [B, H, W, in_channels] -> the moments [B, H/f, W/f, 2 L].
  Lease encoder_forward(const Tensor& image);
  // [B, h, w, L] -> the image [B, h f, w f, out_channels].
  Lease decoder_forward(const Tensor& z);
  // Checks an image's shape against the model; returns {B, H, W}.
  Shape check_image(const Tensor& image, int64_t channels, const char* what) const;

  // Layers (flux_vae_blocks.cpp), each reading x and returning a new activation; `prefix` is
  // the diffusers module name.
  Lease conv(const std::string& prefix, const Tensor& x, const Conv2dShape& shape);
  Lease norm(const std::string& prefix, const Tensor& x, bool silu);
  Lease resnet(const std::string& prefix, const Tensor& x);
  Lease attention(const std::string& prefix, const Tensor& x);
  Lease mid_block(const std::string& prefix, const Tensor& x);
  Lease upsample(const std::string& prefix, const Tensor& x);

  const FluxVaeParameters& params_;
  VaeActivationPool pool_;
};

}  // namespace forge
