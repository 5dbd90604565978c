#pragma once

#include <cstdint>

#include "kernels/cuda/types.h"

namespace forge::cuda {

// latents [batch, channels, height, width] <-> tokens [batch, (height/patch)(width/patch),
// channels patch^2], the layout of ops/patchify.h; fp32 or bf16, both tensors alike.
struct PatchGrid {
  int64_t batch, channels, height, width, patch;
};

void patchify(float* tokens, const float* latents, const PatchGrid& grid);
void patchify(bf16* tokens, const bf16* latents, const PatchGrid& grid);
void unpatchify(float* latents, const float* tokens, const PatchGrid& grid);
void unpatchify(bf16* latents, const bf16* tokens, const PatchGrid& grid);

}  // namespace forge::cuda
