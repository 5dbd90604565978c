// FLUX sampling's denoising loop (NOTE [FLUX sampling]) on the GPU in bf16 against the CPU
// reference in fp32: the same bf16-representable weights, noise and text, a few Euler steps.
// forge sample's whole path on CUDA (prompt encoders, VAE, PNGs) is
// python.test_flux_sample_vs_diffusers's test_cuda_matches_diffusers.
#include <gtest/gtest.h>

#include <cmath>

#include "gpu_testing.h"
#include "model/flux_parameters.h"
#include "train/flux_sampler.h"

namespace forge {
namespace {

using gpu_test::relative_l2;

TEST(GpuFluxSampler, DenoiseMatchesCpu) {
  FluxConfig config = flux_preset("flux-debug");
  config.head_dim = 32;  // heads of 32, as GpuFlux's
  config.axes_dim = {8, 12, 12};
  const FluxShape shape{2, 8, 4, 6};
  Rng rng(gpu_test::seed_for_current_test());
  FluxParameters cpu_params(config);
  for (size_t i = 0; i < cpu_params.specs().size(); ++i) {
    const Tensor& t = cpu_params.tensors()[i];
    const bool matrix = t.ndim() == 2, bias = cpu_params.specs()[i].name.ends_with(".bias");
    const Tensor values =
        gpu_test::random_bf16_values(t.shape(), rng, matrix ? 0.7 / std::sqrt(static_cast<double>(t.dim(1))) : 0.2);
    for (int64_t j = 0; j < t.numel(); ++j) t.data<float>()[j] = (matrix || bias ? 0.0f : 1.0f) + values.data<float>()[j];
  }
  gpu_test::round_to_bf16(cpu_params.flat());
  FluxParameters gpu_params(config, Device::CUDA, DType::BF16);
  gpu_params.assign_from(cpu_params);
  const Tensor noise = gpu_test::random_bf16_values({shape.batch, shape.image_tokens(), config.in_channels}, rng);
  const Tensor text = gpu_test::random_bf16_values({shape.batch, shape.text_tokens, config.context_dim}, rng);
  const Tensor pooled = gpu_test::random_bf16_values({shape.batch, config.pooled_dim}, rng);
  const std::vector<float> sigmas = flux_sampling_sigmas({}, 3, shape.image_tokens());
  const Tensor cpu = noise.clone(), gpu = noise.clone();
  FluxDenoiser(config, shape, Device::CPU, cpu_params).denoise(cpu, text, pooled, sigmas, 3.5f);
  FluxDenoiser(config, shape, Device::CUDA, gpu_params).denoise(gpu, text, pooled, sigmas, 3.5f);
  EXPECT_GT(relative_l2(cpu, noise), 0.1);  // the steps moved the latents
  EXPECT_LT(relative_l2(gpu, cpu), 3e-2);
}

}  // namespace
}  // namespace forge
