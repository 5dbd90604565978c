// Patchify on the CPU: a pure permutation, written as the loops of the token layout
// (ops/patchify.h). For grid cell (i, j) of a sample, feature c p^2 + dy p + dx of its
// token is latent pixel (c, i p + dy, j p + dx). Rows of the token grid (all tokens with the
// same i) are split across threads; patchify gathers into them, unpatchify scatters back,
// and each element is moved by exactly one thread.
#include "kernels/cpu/patchify.h"

#include "core/parallel.h"

namespace forge::cpu {
namespace {

// Calls move(token_element, latent_element) for every element of grid rows [begin, end),
// numbered over the batch's rows (b * rows + i).
template <typename Move>
void for_each_element(const PatchGrid& g, int64_t begin, int64_t end, Move move) {
  const int64_t rows = g.height / g.patch, cols = g.width / g.patch, p = g.patch;
  const int64_t features = g.channels * p * p;
  for (int64_t row = begin; row < end; ++row) {
    const int64_t b = row / rows, i = row % rows;
    for (int64_t j = 0; j < cols; ++j) {
      const int64_t token = (row * cols + j) * features;
      for (int64_t c = 0; c < g.channels; ++c)
        for (int64_t dy = 0; dy < p; ++dy)
          for (int64_t dx = 0; dx < p; ++dx)
            move(token + (c * p + dy) * p + dx, ((b * g.channels + c) * g.height + i * p + dy) * g.width + j * p + dx);
    }
  }
}

int64_t grid_rows(const PatchGrid& g) { return g.batch * (g.height / g.patch); }

}  // namespace

void patchify(float* tokens, const float* latents, const PatchGrid& grid) {
  parallel_for(grid_rows(grid), 4, [&](int64_t begin, int64_t end) {
    for_each_element(grid, begin, end, [&](int64_t t, int64_t l) { tokens[t] = latents[l]; });
  });
}

void unpatchify(float* latents, const float* tokens, const PatchGrid& grid) {
  parallel_for(grid_rows(grid), 4, [&](int64_t begin, int64_t end) {
    for_each_element(grid, begin, end, [&](int64_t t, int64_t l) { latents[l] = tokens[t]; });
  });
}

}  // namespace forge::cpu
