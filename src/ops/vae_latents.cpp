#include "ops/vae_latents.h"

#include "core/op_profile.h"
#include "kernels/cpu/vae_latents.h"
#include "ops/placement.h"
#ifdef FORGE_CUDA
#include "kernels/cuda/vae_latents.h"
#endif

namespace forge {
namespace {

void check_factors(float scale, const char* op) {
  FORGE_CHECK(scale > 0.0f, "{}: scaling factor {} must be positive", op, scale);
}

// The latents' dtype on `device`: fp32 on the CPU, fp32 or bf16 on CUDA.
void expect_latents(const Tensor& t, Device device, const char* what) {
  if (device == Device::CUDA && t.dtype() == DType::BF16) return expect_tensor(t, device, DType::BF16, what);
  expect_tensor(t, device, DType::F32, what);
}

}  // namespace

void vae_latents_from_moments(const Tensor& latents, const Tensor& moments, const Tensor* noise, float scale,
                              float shift) {
  OpProfileScope profile(OpClass::Elementwise, "vae_latents_from_moments");
  check_factors(scale, "vae_latents_from_moments");
  FORGE_CHECK(latents.ndim() == 4, "vae_latents_from_moments: latents {} must be [B, L, h, w]",
              shape_str(latents.shape()));
  const int64_t batch = latents.dim(0), channels = latents.dim(1), pixels = latents.dim(2) * latents.dim(3);
  check_shape(moments, {batch, latents.dim(2), latents.dim(3), 2 * channels}, "vae_latents_from_moments moments");
  if (noise) check_shape(*noise, latents.shape(), "vae_latents_from_moments noise");
  const Device device = moments.device();
  expect_latents(latents, device, "vae_latents_from_moments latents");
  if (noise) expect_tensor(*noise, device, latents.dtype(), "vae_latents_from_moments noise");
  if (device == Device::CUDA) {
    expect_tensor(moments, Device::CUDA, DType::BF16, "vae_latents_from_moments moments");
#ifdef FORGE_CUDA
    if (latents.dtype() == DType::F32)
      cuda::vae_latents_from_moments(latents.data<float>(), bf16_ptr(moments), noise ? noise->data<float>() : nullptr,
                                     batch, channels, pixels, scale, shift);
    else
      cuda::vae_latents_from_moments(bf16_ptr(latents), bf16_ptr(moments), noise ? bf16_ptr(*noise) : nullptr, batch,
                                     channels, pixels, scale, shift);
#else
    fail_without_cuda("vae_latents_from_moments");
#endif
    return;
  }
  expect_tensor(moments, Device::CPU, DType::F32, "vae_latents_from_moments moments");
  cpu::vae_latents_from_moments(latents.data<float>(), moments.data<float>(), noise ? noise->data<float>() : nullptr,
                                batch, channels, pixels, scale, shift);
}

void vae_decoder_input(const Tensor& z, const Tensor& latents, float scale, float shift) {
  OpProfileScope profile(OpClass::Elementwise, "vae_decoder_input");
  check_factors(scale, "vae_decoder_input");
  FORGE_CHECK(latents.ndim() == 4, "vae_decoder_input: latents {} must be [B, L, h, w]", shape_str(latents.shape()));
  const int64_t batch = latents.dim(0), channels = latents.dim(1), pixels = latents.dim(2) * latents.dim(3);
  check_shape(z, {batch, latents.dim(2), latents.dim(3), channels}, "vae_decoder_input z");
  const Device device = z.device();
  expect_latents(latents, device, "vae_decoder_input latents");
  if (device == Device::CUDA) {
    expect_tensor(z, Device::CUDA, DType::BF16, "vae_decoder_input z");
#ifdef FORGE_CUDA
    if (latents.dtype() == DType::F32)
      cuda::vae_decoder_input(bf16_ptr(z), latents.data<float>(), batch, channels, pixels, scale, shift);
    else
      cuda::vae_decoder_input(bf16_ptr(z), bf16_ptr(latents), batch, channels, pixels, scale, shift);
#else
    fail_without_cuda("vae_decoder_input");
#endif
    return;
  }
  expect_tensor(z, Device::CPU, DType::F32, "vae_decoder_input z");
  cpu::vae_decoder_input(z.data<float>(), latents.data<float>(), batch, channels, pixels, scale, shift);
}

}  // namespace forge
