// FLUX's latents from the VAE encoder's output and back to the decoder's input, as diffusers'
// FluxPipeline computes them around AutoencoderKL (NOTE [FLUX VAE latents] in
// model/flux_vae.h):
//   vae_latents_from_moments   moments [B, h, w, 2L] (NHWC: the mean in channels [0, L), the
//                              log-variance in [L, 2L)) -> latents [B, L, h, w] (NCHW, what
//                              ops/patchify.h reads):
//                                z = mean + exp(0.5 clamp(logvar, -30, 20)) noise  (a sample)
//                                z = mean                                 (without noise: the mode)
//                                latents = (z - shift) scale
//   vae_decoder_input          latents [B, L, h, w] -> z [B, h, w, L]: z = latents / scale + shift
// noise is [B, L, h, w] like the latents. CPU: fp32. CUDA: moments and z bf16; latents (and
// noise) fp32 or bf16, computed in fp32.
#pragma once

#include "core/tensor.h"

namespace forge {

void vae_latents_from_moments(const Tensor& latents, const Tensor& moments, const Tensor* noise, float scale,
                              float shift);
void vae_decoder_input(const Tensor& z, const Tensor& latents, float scale, float shift);

}  // namespace forge
