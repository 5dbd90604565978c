// FLUX latents from the VAE encoder's moments and back, on the GPU (ops/vae_latents.h): one
// thread per latent element (b, c, p) of the NCHW latents, reading or writing channel c of
// pixel p of the NHWC side, in fp32 (__expf for the standard deviation). The NHWC side is
// read or written with a stride of L or 2L elements: these run once per image on a latent
// 64 times smaller than the image, so the uncoalesced side is not worth a tiled transpose.
#include "kernels/cuda/vae_latents.h"

#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(bf16* p, float x) { *p = __float2bfloat16(x); }

template <typename T>
__global__ void from_moments_kernel(T* latents, const bf16* moments, const T* noise, int64_t channels, int64_t pixels,
                                    int64_t total, float scale, float shift) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t b = i / (channels * pixels), c = i / pixels % channels, p = i % pixels;
  const bf16* m = moments + (b * pixels + p) * 2 * channels;
  float z = __bfloat162float(m[c]);
  if (noise) {
    const float logvar = fminf(fmaxf(__bfloat162float(m[channels + c]), -30.f), 20.f);
    z += __expf(0.5f * logvar) * to_f32(noise[i]);
  }
  store(latents + i, (z - shift) * scale);
}

template <typename T>
__global__ void decoder_input_kernel(bf16* z, const T* latents, int64_t channels, int64_t pixels, int64_t total,
                                     float scale, float shift) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const int64_t b = i / (channels * pixels), c = i / pixels % channels, p = i % pixels;
  z[(b * pixels + p) * channels + c] = __float2bfloat16(to_f32(latents[i]) / scale + shift);
}

unsigned blocks_for(int64_t total) { return static_cast<unsigned>((total + kThreads - 1) / kThreads); }

template <typename T>
void from_moments(T* latents, const bf16* moments, const T* noise, int64_t batch, int64_t channels, int64_t pixels,
                  float scale, float shift) {
  const int64_t total = batch * channels * pixels;
  if (total == 0) return;
  from_moments_kernel<<<blocks_for(total), kThreads>>>(latents, moments, noise, channels, pixels, total, scale, shift);
  FORGE_CUDA_LAUNCH_CHECK();
}

template <typename T>
void decoder_input(bf16* z, const T* latents, int64_t batch, int64_t channels, int64_t pixels, float scale,
                   float shift) {
  const int64_t total = batch * channels * pixels;
  if (total == 0) return;
  decoder_input_kernel<<<blocks_for(total), kThreads>>>(z, latents, channels, pixels, total, scale, shift);
  FORGE_CUDA_LAUNCH_CHECK();
}

}  // namespace

void vae_latents_from_moments(float* latents, const bf16* moments, const float* noise, int64_t batch,
                              int64_t channels, int64_t pixels, float scale, float shift) {
  from_moments(latents, moments, noise, batch, channels, pixels, scale, shift);
}

void vae_latents_from_moments(bf16* latents, const bf16* moments, const bf16* noise, int64_t batch, int64_t channels,
                              int64_t pixels, float scale, float shift) {
  from_moments(latents, moments, noise, batch, channels, pixels, scale, shift);
}

void vae_decoder_input(bf16* z, const float* latents, int64_t batch, int64_t channels, int64_t pixels, float scale,
                       float shift) {
  decoder_input(z, latents, batch, channels, pixels, scale, shift);
}

void vae_decoder_input(bf16* z, const bf16* latents, int64_t batch, int64_t channels, int64_t pixels, float scale,
                       float shift) {
  decoder_input(z, latents, batch, channels, pixels, scale, shift);
}

}  // namespace forge::cuda
