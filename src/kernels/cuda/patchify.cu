// Patchify on the GPU: the permutation between a latent image [B, C, H, W] and its patch
// tokens [B, (H/p)(W/p), C p^2] (ops/patchify.h), one thread per element, numbered in token
// order: thread e is feature f = e mod C p^2 of token e / C p^2, i.e. latent pixel
// (c, i p + dy, j p + dx) with f = c p^2 + dy p + dx and the token at (i, j) of the grid.
// Token-side accesses are coalesced (patchify's writes, unpatchify's reads); latent-side
// ones come in runs of p consecutive elements. A copy of a few MB per step, bound by memory
// either way, so no shared-memory transpose.
#include "kernels/cuda/patchify.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

// kToTokens: dst is the tokens and dst[e] = src[l]; else dst is the latents and dst[l] = src[e].
template <typename T, bool kToTokens>
__global__ void patchify_kernel(T* dst, const T* src, PatchGrid g, int64_t n) {
  const int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (e >= n) return;
  const int64_t p = g.patch, features = g.channels * p * p;
  const int64_t rows = g.height / p, cols = g.width / p;
  const int64_t f = e % features, token = e / features;
  const int64_t j = token % cols, i = token / cols % rows, b = token / cols / rows;
  const int64_t c = f / (p * p), dy = f / p % p, dx = f % p;
  const int64_t l = ((b * g.channels + c) * g.height + i * p + dy) * g.width + j * p + dx;
  if (kToTokens)
    dst[e] = src[l];
  else
    dst[l] = src[e];
}

template <typename T, bool kToTokens>
void launch(T* dst, const T* src, const PatchGrid& g) {
  const int64_t n = g.batch * g.channels * g.height * g.width;
  if (n == 0) return;
  patchify_kernel<T, kToTokens>
      <<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads>>>(dst, src, g, n);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void patchify(float* tokens, const float* latents, const PatchGrid& grid) {
  launch<float, true>(tokens, latents, grid);
}
void patchify(bf16* tokens, const bf16* latents, const PatchGrid& grid) {
  launch<bf16, true>(tokens, latents, grid);
}
void unpatchify(float* latents, const float* tokens, const PatchGrid& grid) {
  launch<float, false>(latents, tokens, grid);
}
void unpatchify(bf16* latents, const bf16* tokens, const PatchGrid& grid) {
  launch<bf16, false>(latents, tokens, grid);
}

}  // namespace forge::cuda
