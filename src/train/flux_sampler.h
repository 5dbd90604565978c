// Sampling images from a FLUX transformer: the denoising loop of diffusers' FluxPipeline with
// its FlowMatchEulerDiscreteScheduler, the latents' decoding, and the 8-bit image.
//
// NOTE [FLUX sampling]
// forge samples as diffusers' FluxPipeline does (num_inference_steps n, guidance_scale g):
//   1. noise: one standard normal latent [C, h, w] per image (C the transformer's in_channels
//      / 4, h and w the image's sides over the decoder's factor: 8 for FLUX's VAE, 2 for pixel
//      latents), packed 2x2 into h/2 x w/2 tokens of 4C features (_pack_latents,
//      ops/patchify.h). forge draws image k's latent from its counter-based generator
//      (ops/random_normal.h): normal numbers k C h w ... (k + 1) C h w - 1 of the stream
//      `seed`, so an image depends on the seed and its index only, never on the batch it ran
//      in. These are not torch.randn's numbers (torch's CPU generator is a Mersenne twister,
//      its CUDA one another Philox layout): the same seed gives other pictures than diffusers;
//      `forge sample --initial-noise FILE` takes the latents from a file to reproduce a
//      diffusers run exactly.
//   2. sigmas (FlowMatchEulerDiscreteScheduler.set_timesteps with FluxPipeline's sigmas):
//      s_i = linspace(1, 1/n, n)_i in float32; with dynamic shifting (FLUX.1-dev's scheduler)
//      s_i <- e^mu / (e^mu + (1/s_i - 1)), mu = calculate_shift(image tokens) (the line of
//      NOTE [Flow timesteps], base_shift 0.5 at 256 tokens to max_shift 1.15 at 4096); without
//      it (FLUX.1-schnell's) s_i <- shift s_i / (1 + (shift - 1) s_i); then s_n = 0. All in
//      float32 as numpy computes it there.
//   3. for i in 0 .. n-1: v = transformer(x, t_i, guidance g (a guidance-embedding model
//      only), text features, pooled text); x <- x + (s_{i+1} - s_i) v in float32. t_i is
//      what diffusers feeds the model: float32(float32(1000 s_i) / 1000), which the model
//      scales by 1000 again (its timestep embedding).
//   4. x unpacked to [C, h, w] and decoded: FLUX's VAE (decode of latents / scaling_factor +
//      shift_factor, NOTE [FLUX VAE latents]) or pixel latents (NOTE [Pixel latents]), to an
//      image in [-1, 1] (not clamped), then as diffusers' VaeImageProcessor.postprocess:
//      (x / 2 + 0.5) clamped to [0, 1], times 255, rounded half to even (numpy's round), 8 bits.
// The latents stay fp32 on the host between steps (the Euler step is a few hundred thousand
// multiply-adds, next to a transformer forward); the transformer sees them in its compute
// dtype (bf16 on CUDA, as a bf16 FluxPipeline does; there the latents stay bf16 between steps,
// here fp32). No classifier-free guidance: FluxPipeline's true_cfg_scale (a negative prompt)
// is not built.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/image_rgb.h"
#include "model/flux_transformer.h"

namespace forge {

// FlowMatchEulerDiscreteScheduler's settings that FluxPipeline's sigmas go through
// (scheduler/scheduler_config.json); the defaults are FLUX.1-dev's.
struct FluxSamplingSchedule {
  bool dynamic_shift = true;  // use_dynamic_shifting
  double shift = 3.0;         // shift: the fixed shift when not dynamic (FLUX.1-schnell: 1, none)
  double base_shift = 0.5, max_shift = 1.15;
  int64_t base_seq_len = 256, max_seq_len = 4096;  // base_image_seq_len, max_image_seq_len
};

// FLUX.1-dev's schedule, or the one a pipeline folder's scheduler/scheduler_config.json
// describes (`path` the pipeline folder, its scheduler/ folder or the file). Keys forge does
// not compute the same way (karras, exponential or beta sigmas, a terminal shift, inverted or
// stochastic sampling, a linear time shift) are refused naming the file and the key.
FluxSamplingSchedule read_flux_sampling_schedule(const std::string& path);

// The n + 1 sigmas of NOTE [FLUX sampling] (step 2) for an image of image_tokens tokens.
std::vector<float> flux_sampling_sigmas(const FluxSamplingSchedule& schedule, int64_t steps, int64_t image_tokens);

// The time the transformer is given at sigma s: float32(float32(1000 s) / 1000).
float flux_model_time(float sigma);

// Image k's initial latent [C, h, w] for k in [first, first + count): latents [count, C, h, w]
// fp32 on the CPU (NOTE [FLUX sampling], step 1).
void flux_initial_noise(const Tensor& latents, uint64_t seed, int64_t first);

// The denoising loop over one batch shape, on one device with the weights it is given.
class FluxDenoiser {
 public:
  // params: the transformer's weights in the compute dtype on `device` (fp32 CPU, bf16 CUDA);
  // they must outlive the denoiser. shape: batch, text tokens and the token grid.
  FluxDenoiser(const FluxConfig& config, const FluxShape& shape, Device device, FluxParamSource& params);
  ~FluxDenoiser();

  const FluxShape& shape() const { return shape_; }

  // tokens: the packed latents [B, grid_h grid_w, in_channels] fp32 on the CPU, noise in,
  // the denoised latents out. text [B, text_tokens, context_dim] and pooled [B, pooled_dim]
  // fp32 on the CPU. sigmas: flux_sampling_sigmas. on_step(i) after step i, if given.
  void denoise(const Tensor& tokens, const Tensor& text, const Tensor& pooled, const std::vector<float>& sigmas,
               float guidance, const std::function<void(int64_t)>& on_step = {});

 private:
  FluxConfig config_;
  FluxShape shape_;
  Device device_;
  DType dtype_;
  FluxParamSource& params_;
  FluxTransformer model_;
  Tensor x_, text_, pooled_, velocity_, staging_;
};

// 8-bit RGB of an image [3, height, width] with values in [-1, 1] (fp32, CHW): NOTE [FLUX
// sampling], step 4.
RgbImage flux_rgb_image(const float* chw, int64_t height, int64_t width);

}  // namespace forge
