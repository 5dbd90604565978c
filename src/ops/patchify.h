// Latent images to transformer tokens and back: p x p patches of a [B, C, H, W] latent
// become the tokens of a [B, (H/p)(W/p), C p p] sequence, as diffusers'
// FluxPipeline._pack_latents / _unpack_latents do for FLUX (p = 2, C = 16: 64 features):
//   token  (i, j) of the (H/p) x (W/p) grid, row-major: index i (W/p) + j
//   feature c p^2 + dy p + dx  holds  latents[b, c, i p + dy, j p + dx]
// H and W must be multiples of p. unpatchify is the inverse (and patchify's backward).
// Both tensors fp32 (CPU) or the same dtype, fp32 or bf16 (CUDA).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace forge {

void patchify(const Tensor& tokens, const Tensor& latents, int64_t patch);
void unpatchify(const Tensor& latents, const Tensor& tokens, int64_t patch);

}  // namespace forge
