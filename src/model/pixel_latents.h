// Pixel latents: an exact, weightless stand-in for the FLUX VAE, for demonstrations and
// tests that must see what a model learned without the published autoencoder's weights.
//
// NOTE [Pixel latents]
// FLUX trains on 16-channel latents at 1/8 of the image's side and patchifies them 2x2 into
// 64 features per token. The pixel autoencoder keeps that 16-channel interface with a
// lossless fold instead of a learned encoder: the image [B, 3, H, W] in [-1, 1] gets a
// fourth channel of zeros and each 2x2 block of pixels becomes one latent position,
//   latent[b, (dy * 2 + dx) * 4 + c, y, x] = image[b, c, 2 y + dy, 2 x + dx]   (c < 3)
//   latent[b, (dy * 2 + dx) * 4 + 3, y, x] = 0
// so latents are [B, 16, H/2, W/2] and decoding is the exact inverse (channel 3 is dropped).
// A FLUX model of any preset trains on them unchanged (64 features per 2x2-patchified
// token); an image of side 32 is a 16x16 latent, 8x8 = 64 tokens. `forge prep --images
// --vae pixels` writes such latents and `forge sample --vae pixels` decodes them, which is
// what the coloured-shapes demonstration (README, FLUX.1) uses: its samples are then the
// transformer's own output, with no decoder between it and the picture.
#pragma once

#include "core/tensor.h"

namespace forge {

inline constexpr int64_t kPixelLatentChannels = 16;
inline constexpr int64_t kPixelLatentFactor = 2;  // image side / latent side

// image: fp32 CPU [B, 3, H, W], H and W even; latents: fp32 CPU [B, 16, H/2, W/2].
void pixel_latents_encode(const Tensor& latents, const Tensor& image);
// latents: fp32 CPU [B, 16, h, w]; image: fp32 CPU [B, 3, 2h, 2w].
void pixel_latents_decode(const Tensor& image, const Tensor& latents);

}  // namespace forge
