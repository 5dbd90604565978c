#pragma once

#include <cstdint>

namespace forge::cpu {

// ops/vae_latents.h, with `pixels` = h w and `channels` = L; noise may be null.
void vae_latents_from_moments(float* latents, const float* moments, const float* noise, int64_t batch,
                              int64_t channels, int64_t pixels, float scale, float shift);
void vae_decoder_input(float* z, const float* latents, int64_t batch, int64_t channels, int64_t pixels, float scale,
                       float shift);

}  // namespace forge::cpu
