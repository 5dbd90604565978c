#pragma once

#include <cstdint>

namespace forge::cpu {

// latents [batch, channels, height, width] <-> tokens [batch, (height/patch)(width/patch),
// channels patch^2], the layout of ops/patchify.h.
struct PatchGrid {
  int64_t batch, channels, height, width, patch;
};

void patchify(float* tokens, const float* latents, const PatchGrid& grid);
void unpatchify(float* latents, const float* tokens, const PatchGrid& grid);

}  // namespace forge::cpu
