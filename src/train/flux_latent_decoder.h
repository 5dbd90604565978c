// Latents back to images for `forge sample`: FLUX's VAE decoder (model/flux_vae.h) or the
// weightless pixel latents (model/pixel_latents.h), behind one interface.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace forge {

class FluxVae;
class FluxVaeParameters;

class FluxLatentDecoder {
 public:
  // `vae`: "pixels" (NOTE [Pixel latents]), or FLUX VAE weights (a diffusers VAE folder, the
  // pipeline folder holding vae/, or BFL's ae.safetensors: NOTE [FLUX VAE weight files]) run on
  // `device` (fp32 on the CPU, bf16 on CUDA).
  FluxLatentDecoder(const std::string& vae, Device device);
  ~FluxLatentDecoder();

  bool pixels() const { return !vae_; }
  // Image side over latent side: 2 for pixels, the VAE's downsampling (8 for FLUX's).
  int64_t factor() const { return factor_; }
  int64_t latent_channels() const { return latent_channels_; }
  // One word for logs: "pixels" or the VAE's name and path.
  const std::string& description() const { return description_; }

  // latents [B, latent_channels, h, w] fp32 on the CPU (scaled as NOTE [FLUX VAE latents]
  // says); image [B, 3, h factor, w factor] fp32 on the CPU, in [-1, 1] (not clamped).
  void decode(const Tensor& image, const Tensor& latents);

 private:
  std::unique_ptr<FluxVaeParameters> params_;
  std::unique_ptr<FluxVae> vae_;
  Device device_ = Device::CPU;
  int64_t factor_ = 2, latent_channels_ = 16;
  std::string description_;
};

}  // namespace forge
