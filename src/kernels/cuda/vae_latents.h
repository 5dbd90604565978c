#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// ops/vae_latents.h on the GPU, with `pixels` = h w and `channels` = L. moments and z bf16;
// latents and noise (null: the mode) both fp32 or both bf16.
void vae_latents_from_moments(float* latents, const bf16* moments, const float* noise, int64_t batch,
                              int64_t channels, int64_t pixels, float scale, float shift);
void vae_latents_from_moments(bf16* latents, const bf16* moments, const bf16* noise, int64_t batch, int64_t channels,
                              int64_t pixels, float scale, float shift);
void vae_decoder_input(bf16* z, const float* latents, int64_t batch, int64_t channels, int64_t pixels, float scale,
                       float shift);
void vae_decoder_input(bf16* z, const bf16* latents, int64_t batch, int64_t channels, int64_t pixels, float scale,
                       float shift);

}  // namespace forge::cuda
