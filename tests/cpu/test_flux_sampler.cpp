// The FLUX sampling pieces (NOTE [FLUX sampling]): the schedule against its formula, the
// scheduler and transformer configs and their refusals, the noise's indexing, one Euler step
// against the transformer's own forward, the 8-bit conversion. Against diffusers:
// python.test_flux_sample_vs_diffusers.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "ckpt/flux_transformer_config.h"
#include "expect_error.h"
#include "test_data_temp_dir.h"
#include "train/flux_sampler.h"

namespace forge {
namespace {

void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(FluxSampler, SigmasFollowTheShiftedLinspace) {
  const FluxSamplingSchedule dev;
  for (const int64_t steps : {1, 2, 4, 28}) {
    for (const int64_t tokens : {16, 256, 1024, 4096}) {
      const std::vector<float> s = flux_sampling_sigmas(dev, steps, tokens);
      ASSERT_EQ(s.size(), static_cast<size_t>(steps + 1));
      const double mu = 0.5 + (1.15 - 0.5) * static_cast<double>(tokens - 256) / (4096.0 - 256.0);
      for (int64_t i = 0; i < steps; ++i) {
        const double t = steps == 1 ? 1.0 : 1.0 + static_cast<double>(i) * (1.0 / steps - 1.0) / (steps - 1);
        const double want = std::exp(mu) / (std::exp(mu) + (1.0 / t - 1.0));
        EXPECT_NEAR(s[static_cast<size_t>(i)], want, 1e-6) << steps << " steps, " << tokens << " tokens, i " << i;
      }
      EXPECT_EQ(s.front(), 1.0f);
      EXPECT_EQ(s.back(), 0.0f);
      for (size_t i = 1; i < s.size(); ++i) EXPECT_LT(s[i], s[i - 1]);
    }
  }
  // Larger images are shifted towards noise.
  EXPECT_GT(flux_sampling_sigmas(dev, 4, 4096)[2], flux_sampling_sigmas(dev, 4, 256)[2]);
  FluxSamplingSchedule schnell;
  schnell.dynamic_shift = false;
  schnell.shift = 1.0;
  EXPECT_EQ(flux_sampling_sigmas(schnell, 4, 4096), (std::vector<float>{1.0f, 0.75f, 0.5f, 0.25f, 0.0f}));
  FluxSamplingSchedule fixed = schnell;
  fixed.shift = 3.0;
  EXPECT_NEAR(flux_sampling_sigmas(fixed, 2, 1)[1], 3.0 * 0.5 / (1.0 + 2.0 * 0.5), 1e-7);
  expect_error([] { flux_sampling_sigmas({}, 0, 16); }, {"0 steps"});
}

TEST(FluxSampler, ModelTimeIsDiffusersRoundTrip) {
  for (const float s : {1.0f, 0.75f, 0.123456789f, 1e-3f}) EXPECT_EQ(flux_model_time(s), (s * 1000.0f) / 1000.0f);
  EXPECT_EQ(flux_model_time(1.0f), 1.0f);
}

TEST(FluxSampler, SchedulerConfigAndRefusals) {
  TempDir dir;
  EXPECT_TRUE(read_flux_sampling_schedule(dir.file("")).dynamic_shift);  // no config: FLUX.1-dev's
  std::filesystem::create_directories(dir.file("scheduler"));
  const std::string file = dir.file("scheduler/scheduler_config.json");
  write_text(file, R"({"_class_name": "FlowMatchEulerDiscreteScheduler", "shift": 1.0, "use_dynamic_shifting": false,
                       "base_image_seq_len": 256, "max_image_seq_len": 4096, "use_karras_sigmas": false,
                       "shift_terminal": null, "time_shift_type": "exponential"})");
  const FluxSamplingSchedule s = read_flux_sampling_schedule(dir.file(""));
  EXPECT_FALSE(s.dynamic_shift);
  EXPECT_EQ(s.shift, 1.0);
  write_text(file, R"({"use_beta_sigmas": true})");
  expect_error([&] { read_flux_sampling_schedule(dir.file("")); }, {file, "\"use_beta_sigmas\" is true"});
  write_text(file, R"({"time_shift_type": "linear"})");
  expect_error([&] { read_flux_sampling_schedule(file); }, {"\"time_shift_type\" is \"linear\""});
  write_text(file, R"({"_class_name": "EulerDiscreteScheduler"})");
  expect_error([&] { read_flux_sampling_schedule(file); }, {"FlowMatchEulerDiscreteScheduler only"});
  write_text(file, R"({"shift": -1})");
  expect_error([&] { read_flux_sampling_schedule(file); }, {"\"shift\" must be > 0"});
  write_text(file, R"({"shift": "big"})");
  expect_error([&] { read_flux_sampling_schedule(file); }, {"\"shift\" must be a number"});
  write_text(file, R"({"num_train_timesteps": 500})");
  expect_error([&] { read_flux_sampling_schedule(file); }, {"num_train_timesteps"});
}

TEST(FluxSampler, TransformerConfigJson) {
  TempDir dir;
  const std::string file = dir.file("config.json");
  write_text(file, R"({"_class_name": "FluxTransformer2DModel", "guidance_embeds": true})");
  EXPECT_EQ(read_flux_transformer_config(dir.file("")).name, "flux1-dev");
  write_text(file, R"({"guidance_embeds": false, "out_channels": null})");
  EXPECT_EQ(read_flux_transformer_config(file).name, "flux1-schnell");
  write_text(file, R"({"num_layers": 2, "num_single_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                       "joint_attention_dim": 32, "pooled_projection_dim": 16, "guidance_embeds": true,
                       "axes_dims_rope": [4, 6, 6]})");
  EXPECT_EQ(read_flux_transformer_config(file).name, "flux-debug");
  write_text(file, R"({"num_layers": 1, "guidance_embeds": true})");
  const FluxConfig proxy = read_flux_transformer_config(file);
  EXPECT_EQ(proxy.name, "diffusers");
  EXPECT_EQ(proxy.num_double_blocks, 1);
  EXPECT_EQ(proxy.num_single_blocks, 38);
  write_text(file, R"({"patch_size": 2})");
  expect_error([&] { read_flux_transformer_config(file); }, {"\"patch_size\" is 2"});
  write_text(file, R"({"num_layerz": 2})");
  expect_error([&] { read_flux_transformer_config(file); }, {file, "unknown key \"num_layerz\""});
  write_text(file, R"({"_class_name": "SD3Transformer2DModel"})");
  expect_error([&] { read_flux_transformer_config(file); }, {"expected FluxTransformer2DModel"});
  write_text(file, R"({"axes_dims_rope": [16, 56]})");
  expect_error([&] { read_flux_transformer_config(file); }, {file, "axes_dim"});
  write_text(file, R"({"num_attention_heads": 0})");
  expect_error([&] { read_flux_transformer_config(file); }, {"\"num_attention_heads\" must be a positive integer"});
  expect_error([&] { read_flux_transformer_config(dir.file("nothing")); }, {"no config.json"});
}

TEST(FluxSampler, NoiseOfAnImageDependsOnItsIndexOnly) {
  const Tensor three = Tensor::empty({3, 4, 6, 8}), one = Tensor::empty({1, 4, 6, 8});
  flux_initial_noise(three, 11, 0);
  flux_initial_noise(one, 11, 1);
  const int64_t per = 4 * 6 * 8;
  for (int64_t i = 0; i < per; ++i) ASSERT_EQ(three.data<float>()[per + i], one.data<float>()[i]);
  double sum = 0, squares = 0;
  for (int64_t i = 0; i < three.numel(); ++i) {
    sum += three.data<float>()[i];
    squares += three.data<float>()[i] * three.data<float>()[i];
  }
  EXPECT_NEAR(sum / three.numel(), 0.0, 0.15);
  EXPECT_NEAR(squares / three.numel(), 1.0, 0.2);
}

TEST(FluxSampler, OneStepIsTheVelocityFromPureNoise) {
  const FluxConfig config = flux_preset("flux-debug");
  FluxParameters params(config);
  params.initialize(3);
  const FluxShape shape{2, 5, 2, 3};
  const Tensor x = Tensor::empty({2, 6, config.in_channels}), text = Tensor::empty({2, 5, config.context_dim}),
               pooled = Tensor::empty({2, config.pooled_dim});
  flux_initial_noise(x.view({2, config.in_channels, 2, 3}), 1, 0);
  flux_initial_noise(text.view({2, 5, config.context_dim, 1}), 2, 0);
  flux_initial_noise(pooled.view({2, config.pooled_dim, 1, 1}), 3, 0);
  const Tensor start = x.clone();
  FluxTransformer model(config, shape, Device::CPU);
  const Tensor v = Tensor::empty(x.shape());
  model.forward({start, text, pooled, {1.0f, 1.0f}, {2.5f, 2.5f}}, params, v);
  FluxDenoiser denoiser(config, shape, Device::CPU, params);
  int64_t steps_seen = 0;
  denoiser.denoise(x, text, pooled, {1.0f, 0.0f}, 2.5f, [&](int64_t) { ++steps_seen; });
  EXPECT_EQ(steps_seen, 1);
  for (int64_t i = 0; i < x.numel(); ++i)
    ASSERT_EQ(x.data<float>()[i], start.data<float>()[i] - v.data<float>()[i]) << i;
  expect_error([&] { denoiser.denoise(x, text, pooled, {1.0f}, 2.5f); }, {"at least 2"});
  expect_error([&] { denoiser.denoise(text, text, pooled, {1.0f, 0.0f}, 2.5f); }, {"the latent tokens"});
}

TEST(FluxSampler, RgbIsDiffusersPostprocessing) {
  // R: -1, 0, 1, 2; G: values on rounding edges; B: -3 and 1/255 steps.
  const std::vector<float> chw = {-1.0f,
                                  0.0f,
                                  1.0f,
                                  2.0f,  // R
                                  2.0f * (0.5f / 255.0f) - 1.0f,
                                  2.0f * (1.5f / 255.0f) - 1.0f,
                                  0.5f,
                                  -0.5f,
                                  -3.0f,
                                  2.0f / 255.0f - 1.0f,
                                  0.999f,
                                  -0.999f};
  const RgbImage image = flux_rgb_image(chw.data(), 2, 2);
  ASSERT_EQ(image.width, 2);
  ASSERT_EQ(image.height, 2);
  auto px = [&](int x, int y, int c) { return static_cast<int>(image.row(y)[x * 3 + c]); };
  EXPECT_EQ(px(0, 0, 0), 0);
  EXPECT_EQ(px(1, 0, 0), 128);  // 127.5 to even
  EXPECT_EQ(px(0, 1, 0), 255);
  EXPECT_EQ(px(1, 1, 0), 255);
  EXPECT_EQ(px(1, 1, 1), 64);  // 0.25 * 255 = 63.75
  EXPECT_EQ(px(0, 0, 2), 0);
  EXPECT_EQ(px(1, 0, 2), 1);
}

}  // namespace
}  // namespace forge
