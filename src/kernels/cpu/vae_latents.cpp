// FLUX latents from the VAE encoder's moments and back (ops/vae_latents.h): elementwise, with
// the NHWC <-> NCHW transpose folded into the indexing. Written per latent element
// (b, c, p), reading moment channels c and L + c of pixel p.
#include "kernels/cpu/vae_latents.h"

#include <algorithm>
#include <cmath>

#include "core/parallel.h"

namespace forge::cpu {

void vae_latents_from_moments(float* latents, const float* moments, const float* noise, int64_t batch,
                              int64_t channels, int64_t pixels, float scale, float shift) {
  parallel_for(batch * channels * pixels, 8192, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (channels * pixels), c = i / pixels % channels, p = i % pixels;
      const float* m = moments + (b * pixels + p) * 2 * channels;
      float z = m[c];
      if (noise) z += std::exp(0.5f * std::clamp(m[channels + c], -30.0f, 20.0f)) * noise[i];
      latents[i] = (z - shift) * scale;
    }
  });
}

void vae_decoder_input(float* z, const float* latents, int64_t batch, int64_t channels, int64_t pixels, float scale,
                       float shift) {
  parallel_for(batch * channels * pixels, 8192, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (channels * pixels), c = i / pixels % channels, p = i % pixels;
      z[(b * pixels + p) * channels + c] = latents[i] / scale + shift;
    }
  });
}

}  // namespace forge::cpu
