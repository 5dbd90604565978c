// FLUX sampling: NOTE [FLUX sampling] in flux_sampler.h.
#include "train/flux_sampler.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_input.h"
#include "ops/convert.h"
#include "ops/random_normal.h"
#include "train/flow_timesteps.h"

namespace forge {
namespace fs = std::filesystem;

namespace {

std::string scheduler_config_file(const std::string& path) {
  if (fs::is_regular_file(path)) return path;
  for (const fs::path& candidate :
       {fs::path(path) / "scheduler" / "scheduler_config.json", fs::path(path) / "scheduler_config.json"})
    if (fs::is_regular_file(candidate)) return candidate.string();
  return "";
}

}  // namespace

FluxSamplingSchedule read_flux_sampling_schedule(const std::string& path) {
  FluxSamplingSchedule s;
  const std::string file = scheduler_config_file(path);
  if (file.empty()) return s;
  const nlohmann::json j = read_json_file(file, "the scheduler's config");
  if (!(j.is_object())) FORGE_FAIL("{}: expected a JSON object (FlowMatchEulerDiscreteScheduler's config)", file);
  auto number = [&](const char* key, double& out) {
    if (!j.contains(key)) return;
    if (!(j[key].is_number())) FORGE_FAIL("{}: \"{}\" must be a number, got {}", file, key, j[key].dump());
    out = j[key].get<double>();
  };
  auto integer = [&](const char* key, int64_t& out) {
    if (!j.contains(key)) return;
    if (!(j[key].is_number_integer())) FORGE_FAIL("{}: \"{}\" must be an integer, got {}", file, key, j[key].dump());
    out = j[key].get<int64_t>();
  };
  // Keys whose other values forge does not compute: each must be absent or as given.
  auto expect = [&](const char* key, const nlohmann::json& want, const char* why) {
    if (j.contains(key) && j[key] != want)
      FORGE_FAIL("{}: \"{}\" is {}; forge samples with {} only ({})", file, key, j[key].dump(), want.dump(), why);
  };
  if (j.contains("_class_name"))
    if (!(j["_class_name"] == "FlowMatchEulerDiscreteScheduler"))
      FORGE_FAIL("{}: \"_class_name\" is {}; forge samples with FlowMatchEulerDiscreteScheduler only", file,
                 j["_class_name"].dump());
  if (j.contains("use_dynamic_shifting")) {
    if (!(j["use_dynamic_shifting"].is_boolean()))
      FORGE_FAIL("{}: \"use_dynamic_shifting\" must be true or false", file);
    s.dynamic_shift = j["use_dynamic_shifting"].get<bool>();
  }
  number("shift", s.shift);
  number("base_shift", s.base_shift);
  number("max_shift", s.max_shift);
  integer("base_image_seq_len", s.base_seq_len);
  integer("max_image_seq_len", s.max_seq_len);
  expect("num_train_timesteps", 1000, "FluxPipeline divides the scheduler's timesteps by 1000");
  expect("time_shift_type", "exponential", "FLUX's shift");
  for (const char* key :
       {"use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas", "stochastic_sampling"})
    expect(key, false, "FLUX's Euler sampling");
  expect("shift_terminal", nullptr, "FLUX's Euler sampling");
  if (!(std::isfinite(s.shift) && s.shift > 0)) FORGE_FAIL("{}: \"shift\" must be > 0, got {}", file, s.shift);
  if (!(std::isfinite(s.base_shift) && std::isfinite(s.max_shift)))
    FORGE_FAIL("{}: base_shift and max_shift must be finite", file);
  if (!(s.base_seq_len >= 1 && s.max_seq_len != s.base_seq_len))
    FORGE_FAIL("{}: base_image_seq_len ({}) must be >= 1 and differ from max_image_seq_len ({})", file, s.base_seq_len,
               s.max_seq_len);
  return s;
}

std::vector<float> flux_sampling_sigmas(const FluxSamplingSchedule& schedule, int64_t steps, int64_t image_tokens) {
  if (!(steps >= 1)) FORGE_FAIL("FLUX sampling: {} steps; at least 1", steps);
  if (!(image_tokens >= 1)) FORGE_FAIL("FLUX sampling: an image of {} tokens", image_tokens);
  std::vector<float> sigmas(static_cast<size_t>(steps + 1), 0.0f);
  // numpy's linspace(1, 1/n, n) in float64 (start + i * step, the last exactly 1/n), then float32.
  const double end = 1.0 / static_cast<double>(steps);
  const double step = steps > 1 ? (end - 1.0) / static_cast<double>(steps - 1) : 0.0;
  FlowTimestepSampling line;
  line.base_shift = schedule.base_shift;
  line.max_shift = schedule.max_shift;
  line.base_seq_len = schedule.base_seq_len;
  line.max_seq_len = schedule.max_seq_len;
  const float e = static_cast<float>(std::exp(flow_shift_mu(line, image_tokens)));
  const float shift = static_cast<float>(schedule.shift);
  for (int64_t i = 0; i < steps; ++i) {
    const float s = static_cast<float>(i == steps - 1 ? end : 1.0 + static_cast<double>(i) * step);
    sigmas[static_cast<size_t>(i)] =
        schedule.dynamic_shift ? e / (e + (1.0f / s - 1.0f)) : shift * s / (1.0f + (shift - 1.0f) * s);
  }
  return sigmas;
}

float flux_model_time(float sigma) { return (sigma * 1000.0f) / 1000.0f; }

void flux_initial_noise(const Tensor& latents, uint64_t seed, int64_t first) {
  if (!(latents.ndim() == 4 && latents.device() == Device::CPU && latents.dtype() == DType::F32))
    FORGE_FAIL("flux_initial_noise: latents must be fp32 [N, C, h, w] on the CPU, got {}", shape_str(latents.shape()));
  if (!(first >= 0)) FORGE_FAIL("flux_initial_noise: image index {}", first);
  const int64_t per_image = latents.numel() / std::max<int64_t>(1, latents.dim(0));
  random_normal(latents, seed, static_cast<uint64_t>(first) * static_cast<uint64_t>(per_image));
}

FluxDenoiser::FluxDenoiser(const FluxConfig& config, const FluxShape& shape, Device device, FluxParamSource& params)
    : config_(config),
      shape_(shape),
      device_(device),
      dtype_(device == Device::CUDA ? DType::BF16 : DType::F32),
      params_(params),
      model_(config, shape, device, ActivationCheckpoint::Full) {
  // Full checkpointing keeps one set of block intermediates: a forward without a backward
  // needs no more (NOTE [FLUX activation checkpointing]).
  const Shape tokens{shape.batch, shape.image_tokens(), config.in_channels};
  x_ = Tensor::empty(tokens, dtype_, device);
  velocity_ = Tensor::empty({shape.batch, shape.image_tokens(), config.resolved_out_channels()}, dtype_, device);
  text_ = Tensor::empty({shape.batch, shape.text_tokens, config.context_dim}, dtype_, device);
  pooled_ = Tensor::empty({shape.batch, config.pooled_dim}, dtype_, device);
  if (!(config.resolved_out_channels() == config.in_channels))
    FORGE_FAIL("FLUX sampling: the model predicts {} features per token for inputs of {}; sampling needs them equal",
               config.resolved_out_channels(), config.in_channels);
}

FluxDenoiser::~FluxDenoiser() = default;

namespace {

void check_host(const Tensor& t, const Shape& shape, const char* what) {
  if (!(t.device() == Device::CPU && t.dtype() == DType::F32 && t.shape() == shape))
    FORGE_FAIL("FLUX sampling: {} must be fp32 {} on the CPU, got {} {} on {}", what, shape_str(shape),
               dtype_name(t.dtype()), shape_str(t.shape()), device_name(t.device()));
}

}  // namespace

void FluxDenoiser::denoise(const Tensor& tokens, const Tensor& text, const Tensor& pooled,
                           const std::vector<float>& sigmas, float guidance,
                           const std::function<void(int64_t)>& on_step) {
  const int64_t b = shape_.batch;
  check_host(tokens, x_.shape(), "the latent tokens");
  check_host(text, text_.shape(), "the text features");
  check_host(pooled, pooled_.shape(), "the pooled text");
  if (!(sigmas.size() >= 2)) FORGE_FAIL("FLUX sampling: {} sigmas; at least 2 (one step)", sigmas.size());
  copy_converted(text_, text);
  copy_converted(pooled_, pooled);
  const Tensor velocity = Tensor::empty(velocity_.shape());
  float* x = tokens.data<float>();
  const float* v = velocity.data<float>();
  const int64_t n = tokens.numel();
  std::vector<float> guidances;
  if (config_.guidance_embeds) guidances.assign(static_cast<size_t>(b), guidance);
  for (size_t i = 0; i + 1 < sigmas.size(); ++i) {
    copy_converted(x_, tokens);
    const FluxInputs inputs{x_, text_, pooled_, std::vector<float>(static_cast<size_t>(b), flux_model_time(sigmas[i])),
                            guidances};
    model_.forward(inputs, params_, velocity_);
    copy_converted(velocity, velocity_);
    const float dt = sigmas[i + 1] - sigmas[i];
    for (int64_t j = 0; j < n; ++j) x[j] = x[j] + dt * v[j];
    if (on_step) on_step(static_cast<int64_t>(i));
  }
}

RgbImage flux_rgb_image(const float* chw, int64_t height, int64_t width) {
  RgbImage image(static_cast<int>(width), static_cast<int>(height));
  const int64_t plane = height * width;
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x)
      for (int64_t c = 0; c < 3; ++c) {
        // float32 as torch computes (x / 2 + 0.5).clamp(0, 1); numpy's (v * 255).round() in
        // float32, half to even (nearbyint under the default rounding mode).
        const float value = std::clamp(chw[c * plane + y * width + x] / 2.0f + 0.5f, 0.0f, 1.0f);
        image.row(static_cast<int>(y))[x * 3 + c] = static_cast<uint8_t>(std::nearbyint(value * 255.0f));
      }
  return image;
}

}  // namespace forge
