// forge sample: NOTE [FLUX sampling] in train/flux_sampler.h, from the command line.
//
//   forge sample --pipeline /models/FLUX.1-dev --prompt "a red cube on a table" --output cube.png
//   forge sample --transformer runs/flux/diffusers --pipeline /models/FLUX.1-dev
//                --prompts prompts.txt --images-per-prompt 2 --output samples/
//   forge sample --transformer runs/shapes/diffusers --vae pixels --t5 T5 --t5-tokenizer T5
//                --clip CLIP --clip-tokenizer CLIP --width 64 --height 64 --output shapes/
//
// Every flag is checked before anything heavy is loaded, and every output path before the
// first image is drawn: an existing file is never replaced without --overwrite.
#include "cli/sample_command.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>

#include "ckpt/flux_transformer_config.h"
#include "ckpt/flux_vae_weights.h"
#include "ckpt/flux_weights.h"
#include "ckpt/safetensors.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "data/image_png.h"
#include "ops/patchify.h"
#include "train/flux_latent_decoder.h"
#include "train/flux_prompt_encoder.h"
#include "train/flux_sampler.h"

namespace forge {
namespace fs = std::filesystem;

CLI::App* add_sample_command(CLI::App& app, SampleOptions& o) {
  CLI::App* s = app.add_subcommand(
      "sample", "Draw images from a FLUX transformer (diffusers' FluxPipeline sampling) and write them as PNG files");
  s->footer(
      "Examples:\n"
      "  forge sample --pipeline /models/FLUX.1-dev --prompt 'a red cube' --output cube.png\n"
      "  forge sample --transformer RUN_DIR/diffusers --pipeline /models/FLUX.1-dev --prompts prompts.txt "
      "--output samples/\n"
      "The initial noise is forge's counter-based normal generator, not torch.randn: the same seed gives other "
      "images than diffusers does; --initial-noise takes diffusers' latents from a file.");
  s->add_option("--transformer", o.transformer,
                "FLUX transformer weights: a diffusers folder (its config.json gives the architecture; what a FLUX "
                "run exports with flux.last_save_in_diffusers) or BFL's single file (with --model). Default: the "
                "--pipeline folder's transformer/");
  s->add_option("--model", o.model,
                "the architecture: flux1-dev, flux1-schnell, flux-small or flux-debug (default: the folder's config.json)");
  s->add_option("--num-double-blocks", o.double_blocks, "with --model: fewer double-stream blocks (a proxy's)");
  s->add_option("--num-single-blocks", o.single_blocks, "with --model: fewer single-stream blocks (a proxy's)");
  s->add_option("--pipeline", o.pipeline,
                "a FluxPipeline folder: vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/ (and "
                "scheduler/, transformer/) supply every file the other flags leave out");
  s->add_option("--vae", o.vae,
                "the VAE (a diffusers folder or BFL's ae.safetensors), or 'pixels' (NOTE [Pixel "
                "latents]: a weightless 2x fold of the image)");
  s->add_option("--t5", o.t5, "T5 encoder folder (FLUX.1's text_encoder_2)");
  s->add_option("--t5-tokenizer", o.t5_tokenizer, "T5 tokenizer: spiece.model, tokenizer.json or a folder");
  s->add_option("--clip", o.clip, "CLIP text encoder folder or .safetensors file (FLUX.1's text_encoder)");
  s->add_option("--clip-tokenizer", o.clip_tokenizer, "CLIP tokenizer folder (vocab.json + merges.txt)");
  s->add_option("--scheduler", o.scheduler,
                "FlowMatchEulerDiscreteScheduler's scheduler_config.json or its folder (default: the --pipeline "
                "folder's scheduler/, else FLUX.1-dev's: dynamic shifting; FLUX.1-schnell's has none)");
  s->add_option("--prompt", o.prompts, "a caption (repeatable; before --prompts' lines)");
  s->add_option("--prompts", o.prompts_file, "a text file of captions, one a line (empty lines skipped)");
  s->add_option("--width", o.width,
                "image width in pixels, a multiple of 16 with FLUX's VAE (4 with pixels) (default: 1024 with the "
                "VAE, 256 with pixels: 128 latent positions, as FluxPipeline)")
      ->each([&o](const std::string&) { o.width_given = true; });
  s->add_option("--height", o.height, "image height in pixels (as --width)")->each([&o](const std::string&) {
    o.height_given = true;
  });
  s->add_option("--steps", o.steps, "denoising steps")->capture_default_str();
  s->add_option("--guidance", o.guidance, "guidance scale for a guidance-distilled model (FLUX.1-dev)")
      ->capture_default_str();
  s->add_option("--seed", o.seed, "seed of the initial noise")->capture_default_str();
  s->add_option("--images-per-prompt", o.images_per_prompt, "images drawn for each caption")->capture_default_str();
  s->add_option("--batch-size", o.batch_size, "images denoised together")->capture_default_str();
  s->add_option("--text-tokens", o.text_tokens, "T5 tokens per caption, 1 to 512 (FluxPipeline's max_sequence_length)")
      ->capture_default_str();
  s->add_option("--device", o.device, "cpu or cuda")->capture_default_str();
  s->add_option("--output,-o", o.output,
                "FILE.png for one image, else a folder of NNN-<caption>.png files (NNN the image's number)")
      ->required();
  s->add_flag("--overwrite", o.overwrite, "replace existing output files");
  s->add_option("--initial-noise", o.initial_noise,
                "a .safetensors file holding one tensor [images, C, h, w]: the initial latents (before 2x2 packing) "
                "instead of forge's noise, e.g. torch.randn's to reproduce diffusers");
  return s;
}

namespace {

// A file name piece from a caption: lowercase ASCII letters and digits, other runs as '-'.
std::string slug(const std::string& caption) {
  std::string out;
  for (const unsigned char c : caption) {
    if (out.size() >= 48) break;
    if (std::isalnum(c) && c < 128)
      out += static_cast<char>(std::tolower(c));
    else if (!out.empty() && out.back() != '-')
      out += '-';
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out.empty() ? "image" : out;
}

bool is_png_path(const std::string& path) {
  std::string ext = fs::path(path).extension().string();
  for (char& c : ext) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return ext == ".png";
}

std::vector<std::string> read_prompts(const SampleOptions& o) {
  std::vector<std::string> prompts = o.prompts;
  if (!o.prompts_file.empty()) {
    std::ifstream in(o.prompts_file, std::ios::binary);
    if (!(in.good())) FORGE_FAIL("--prompts {}: cannot open the file", o.prompts_file);
    std::string line;
    int64_t number = 0, read = 0;
    while (std::getline(in, line)) {
      ++number;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line.find_first_not_of(" \t") == std::string::npos) continue;
      prompts.push_back(line);
      ++read;
    }
    if (!(read > 0)) FORGE_FAIL("--prompts {}: no caption in its {} line(s)", o.prompts_file, number);
  }
  if (prompts.empty()) FORGE_FAIL("no caption: give --prompt TEXT (repeatable) or --prompts FILE");
  return prompts;
}

// Where each image goes: --output itself (one image, a .png path) or OUTPUT/NNN-<caption>.png.
std::vector<std::string> output_paths(const SampleOptions& o, const std::vector<std::string>& prompts) {
  const int64_t count = static_cast<int64_t>(prompts.size()) * o.images_per_prompt;
  std::error_code error;
  if (is_png_path(o.output)) {
    if (!(count == 1))
      FORGE_FAIL("--output {}: one PNG file, but {} images are drawn ({} caption(s) x {} per caption); give a folder",
                 o.output, count, prompts.size(), o.images_per_prompt);
    if (fs::is_directory(o.output, error)) FORGE_FAIL("--output {}: is a folder, not a file", o.output);
    return {o.output};
  }
  if (fs::exists(o.output, error) && !fs::is_directory(o.output, error))
    FORGE_FAIL("--output {}: exists and is not a folder (a single image's path must end in .png)", o.output);
  const int digits = std::max<int>(3, static_cast<int>(std::to_string(count - 1).size()));
  std::vector<std::string> paths;
  for (int64_t i = 0; i < count; ++i)
    paths.push_back((fs::path(o.output) / fmt::format("{:0{}d}-{}.png", i, digits,
                                                      slug(prompts[static_cast<size_t>(i / o.images_per_prompt)])))
                        .string());
  return paths;
}

// The flags, each checked, with the pipeline folder's files filled in.
struct SamplePlan {
  SampleOptions o;
  Device device = Device::CPU;
  FluxConfig config;
  FluxSamplingSchedule schedule;
  std::vector<std::string> prompts, outputs;
  int64_t factor = 8, latent_channels = 16;
};

std::string from_pipeline(const std::string& given, const std::string& pipeline, const char* flag) {
  if (!given.empty()) return given;
  if (pipeline.empty()) FORGE_FAIL("{} is needed (or --pipeline DIR, whose files stand in for it)", flag);
  return pipeline;
}

SamplePlan plan(const SampleOptions& options) {
  SamplePlan p;
  SampleOptions& o = p.o;
  o = options;
  if (!(o.device == "cpu" || o.device == "cuda")) FORGE_FAIL("--device '{}': expected cpu or cuda", o.device);
  p.device = o.device == "cuda" ? Device::CUDA : Device::CPU;
  if (p.device == Device::CUDA && !cuda_available())
    FORGE_FAIL("--device cuda: no GPU is visible, or this build of forge has no CUDA backend");
  std::error_code error;
  if (!o.pipeline.empty())
    if (!(fs::is_directory(o.pipeline, error)))
      FORGE_FAIL(
          "--pipeline {}: not a folder (a FluxPipeline folder holds vae/, "
          "text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/)",
          o.pipeline);
  o.transformer = from_pipeline(o.transformer, o.pipeline, "--transformer");
  o.vae = from_pipeline(o.vae, o.pipeline, "--vae");
  o.t5 = from_pipeline(o.t5, o.pipeline, "--t5");
  o.clip = from_pipeline(o.clip, o.pipeline, "--clip");
  o.t5_tokenizer = from_pipeline(o.t5_tokenizer, o.pipeline, "--t5-tokenizer");
  o.clip_tokenizer = from_pipeline(o.clip_tokenizer, o.pipeline, "--clip-tokenizer");
  for (const auto& [flag, path] :
       std::vector<std::pair<const char*, std::string>>{{"--transformer", o.transformer},
                                                        {"--t5", o.t5},
                                                        {"--clip", o.clip},
                                                        {"--t5-tokenizer", o.t5_tokenizer},
                                                        {"--clip-tokenizer", o.clip_tokenizer},
                                                        {"--vae", o.vae}})
    if (!(path == "pixels" ? std::string(flag) == "--vae" : fs::exists(path, error)))
      FORGE_FAIL("{} {}: not found", flag, path);
  if (!o.initial_noise.empty())
    if (!(fs::is_regular_file(o.initial_noise, error))) FORGE_FAIL("--initial-noise {}: not found", o.initial_noise);

  if (!(o.steps >= 1 && o.steps <= 10000)) FORGE_FAIL("--steps {}: expected 1 to 10000", o.steps);
  if (!(std::isfinite(o.guidance) && o.guidance >= 0))
    FORGE_FAIL("--guidance {}: expected a finite number >= 0", o.guidance);
  if (!(o.images_per_prompt >= 1 && o.images_per_prompt <= 100000))
    FORGE_FAIL("--images-per-prompt {}: expected 1 to 100000", o.images_per_prompt);
  if (!(o.batch_size >= 1 && o.batch_size <= 4096)) FORGE_FAIL("--batch-size {}: expected 1 to 4096", o.batch_size);
  if (!(o.text_tokens >= 1 && o.text_tokens <= 512))
    FORGE_FAIL("--text-tokens {}: expected 1 to 512 (FluxPipeline's max_sequence_length at most)", o.text_tokens);

  // The architecture: a preset (--model) or the folder's config.json.
  const bool blocks_given = o.double_blocks != -1 || o.single_blocks != -1;
  if (!o.model.empty()) {
    if (!(is_flux_preset(o.model)))
      FORGE_FAIL("--model '{}': expected one of {}", o.model, fmt::join(flux_preset_names(), ", "));
    p.config = flux_preset(o.model);
    if (!(o.double_blocks == -1 || o.double_blocks >= 0))
      FORGE_FAIL("--num-double-blocks {}: expected >= 0", o.double_blocks);
    if (!(o.single_blocks == -1 || o.single_blocks >= 0))
      FORGE_FAIL("--num-single-blocks {}: expected >= 0", o.single_blocks);
    if (o.double_blocks >= 0) p.config.num_double_blocks = o.double_blocks;
    if (o.single_blocks >= 0) p.config.num_single_blocks = o.single_blocks;
    p.config.validate("--model " + o.model);
  } else {
    if (blocks_given)
      FORGE_FAIL(
          "--num-double-blocks and --num-single-blocks go with --model (a folder's config.json "
          "gives its block counts)");
    if (flux_transformer_config_file(o.transformer).empty())
      FORGE_FAIL(
          "--transformer {}: no config.json to read the architecture from; give --model flux1-dev|flux1-schnell|flux-small|"
          "flux-debug (BFL's single file has no config)",
          o.transformer);
    p.config = read_flux_transformer_config(o.transformer);
  }
  if (!(p.config.in_channels % 4 == 0))
    FORGE_FAIL(
        "the transformer takes {} features per token; FLUX's 2x2 packing needs a "
        "multiple of 4",
        p.config.in_channels);

  // The decoder's geometry, from its config alone (its weights come later).
  if (o.vae == "pixels") {
    p.factor = 2;
    p.latent_channels = 16;
  } else {
    const FluxVaeConfig vae = flux_vae_config_at(o.vae);
    p.factor = vae.downsample_factor();
    p.latent_channels = vae.latent_channels;
  }
  if (!(p.latent_channels * 4 == p.config.in_channels))
    FORGE_FAIL("--vae {}: its latents have {} channels, 2x2-packed {} features; the transformer ({}) takes {}", o.vae,
               p.latent_channels, p.latent_channels * 4, o.transformer, p.config.in_channels);
  const int64_t multiple = 2 * p.factor;
  if (!o.width_given) o.width = 128 * p.factor;
  if (!o.height_given) o.height = 128 * p.factor;
  for (const auto& [flag, side] : {std::pair{"--width", o.width}, std::pair{"--height", o.height}})
    if (!(side > 0 && side % multiple == 0 && side <= 65536))
      FORGE_FAIL("{} {}: expected a positive multiple of {} up to 65536 (the decoder's {}x and the 2x2 packing)", flag,
                 side, multiple, p.factor);
  if (!o.scheduler.empty() && !fs::exists(o.scheduler, error)) FORGE_FAIL("--scheduler {}: not found", o.scheduler);
  if (!o.scheduler.empty()) {
    const fs::path dir(o.scheduler);
    if (fs::is_directory(dir, error) && !fs::exists(dir / "scheduler_config.json", error) &&
        !fs::exists(dir / "scheduler" / "scheduler_config.json", error))
      FORGE_FAIL("--scheduler {}: no scheduler_config.json in it", o.scheduler);
    p.schedule = read_flux_sampling_schedule(o.scheduler);
  } else if (!o.pipeline.empty()) {
    p.schedule = read_flux_sampling_schedule(o.pipeline);
  }
  p.prompts = read_prompts(o);
  p.outputs = output_paths(o, p.prompts);
  if (!o.overwrite)
    for (const std::string& path : p.outputs)
      if (fs::exists(path, error))
        FORGE_FAIL("{} exists; forge sample does not replace files without --overwrite", path);
  return p;
}

// The initial latents of --initial-noise: [images, C, h, w].
Tensor read_initial_noise(const std::string& path, const Shape& shape) {
  const SafetensorsFile file(path);
  if (!(file.entries().size() == 1))
    FORGE_FAIL("--initial-noise {}: holds {} tensors; expected one, {}", path, file.entries().size(), shape_str(shape));
  const SafetensorsEntry& e = file.entries().front();
  if (!(e.shape == shape))
    FORGE_FAIL(
        "--initial-noise {}: tensor '{}' is {}; expected {} (images, latent channels, "
        "height and width over the decoder's factor)",
        path, e.name, shape_str(e.shape), shape_str(shape));
  Tensor t = Tensor::empty(shape);
  file.read_as_float(e, t.data<float>());
  for (int64_t i = 0; i < t.numel(); ++i)
    if (!(std::isfinite(t.data<float>()[i])))
      FORGE_FAIL("--initial-noise {}: element {} of '{}' is not finite", path, i, e.name);
  return t;
}

}  // namespace

int run_sample(const SampleOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  const SamplePlan p = plan(options);
  const SampleOptions& o = p.o;
  const FluxConfig& c = p.config;
  const int64_t count = static_cast<int64_t>(p.outputs.size());
  const int64_t h = o.height / p.factor, w = o.width / p.factor;
  if (!c.guidance_embeds && options.guidance != SampleOptions{}.guidance)
    log_info("{} has no guidance embedding: --guidance is not used", c.name);
  std::optional<Tensor> given_noise;
  if (!o.initial_noise.empty()) given_noise = read_initial_noise(o.initial_noise, {count, p.latent_channels, h, w});

  // The captions first, so the text encoders are freed before the transformer loads.
  const int64_t prompt_count = static_cast<int64_t>(p.prompts.size());
  Tensor text, pooled;
  {
    FluxPromptEncoder encoder({o.t5, o.t5_tokenizer, o.clip, o.clip_tokenizer}, p.device, o.text_tokens);
    if (!(encoder.text_dim() == c.context_dim))
      FORGE_FAIL("--t5 {}: its features are {} wide; the transformer ({}) reads {} (joint_attention_dim)", o.t5,
                 encoder.text_dim(), c.name, c.context_dim);
    if (!(encoder.pooled_dim() == c.pooled_dim))
      FORGE_FAIL("--clip {}: its pooled vector is {} wide; the transformer ({}) reads {} (pooled_projection_dim)",
                 o.clip, encoder.pooled_dim(), c.name, c.pooled_dim);
    text = Tensor::empty({prompt_count, o.text_tokens, c.context_dim});
    pooled = Tensor::empty({prompt_count, c.pooled_dim});
    // In batches of --batch-size captions (T5's attention scores grow with the batch).
    for (int64_t first = 0; first < prompt_count; first += o.batch_size) {
      const int64_t last = std::min(prompt_count, first + o.batch_size);
      encoder.encode({p.prompts.begin() + first, p.prompts.begin() + last}, text.narrow(first, last),
                     pooled.narrow(first, last));
    }
    log_info("encoded {} caption(s) with T5 ({} tokens) and CLIP", prompt_count, o.text_tokens);
  }

  std::unique_ptr<FluxParameters> weights = std::make_unique<FluxParameters>(c);
  load_flux_weights(o.transformer, *weights);
  if (p.device == Device::CUDA) {
    auto compute = std::make_unique<FluxParameters>(c, Device::CUDA, DType::BF16);
    compute->assign_from(*weights);
    weights = std::move(compute);
  }
  log_info("FLUX transformer {} ({} double + {} single blocks) from {} on {}", c.name, c.num_double_blocks,
           c.num_single_blocks, o.transformer, o.device);
  FluxLatentDecoder decoder(o.vae, p.device);

  const FluxShape base{1, o.text_tokens, h / 2, w / 2};
  const std::vector<float> sigmas = flux_sampling_sigmas(p.schedule, o.steps, base.image_tokens());
  std::unique_ptr<FluxDenoiser> denoiser;
  for (int64_t first = 0; first < count; first += o.batch_size) {
    const int64_t b = std::min(o.batch_size, count - first);
    if (!denoiser || denoiser->shape().batch != b) {
      denoiser.reset();
      FluxShape shape = base;
      shape.batch = b;
      denoiser = std::make_unique<FluxDenoiser>(c, shape, p.device, *weights);
    }
    const Tensor latents = Tensor::empty({b, p.latent_channels, h, w});
    if (given_noise)
      latents.copy_from(given_noise->narrow(first, first + b));
    else
      flux_initial_noise(latents, o.seed, first);
    const Tensor tokens = Tensor::empty({b, base.image_tokens(), c.in_channels});
    patchify(tokens, latents, 2);
    const Tensor batch_text = Tensor::empty({b, o.text_tokens, c.context_dim});
    const Tensor batch_pooled = Tensor::empty({b, c.pooled_dim});
    for (int64_t j = 0; j < b; ++j) {
      const int64_t prompt = (first + j) / o.images_per_prompt;
      batch_text.narrow(j, j + 1).copy_from(text.narrow(prompt, prompt + 1));
      batch_pooled.narrow(j, j + 1).copy_from(pooled.narrow(prompt, prompt + 1));
    }
    const auto batch_start = std::chrono::steady_clock::now();
    denoiser->denoise(tokens, batch_text, batch_pooled, sigmas, static_cast<float>(o.guidance), [&](int64_t step) {
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - batch_start).count();
      const std::string which =
          b == 1 ? fmt::format("image {}", first + 1) : fmt::format("images {}-{}", first + 1, first + b);
      log_info("{} of {}: step {}/{} ({:.1f} s)", which, count, step + 1, o.steps, seconds);
    });
    unpatchify(latents, tokens, 2);
    const Tensor image = Tensor::empty({b, 3, o.height, o.width});
    decoder.decode(image, latents);
    for (int64_t j = 0; j < b; ++j) {
      const std::string& path = p.outputs[static_cast<size_t>(first + j)];
      const fs::path parent = fs::path(path).parent_path();
      if (!parent.empty()) fs::create_directories(parent);
      write_png_file(path, flux_rgb_image(image.data<float>() + j * 3 * o.height * o.width, o.height, o.width));
      log_info("wrote {}", path);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  log_info("{} image(s) of {}x{} in {:.1f} s ({} steps, decoder: {})", count, o.width, o.height, seconds, o.steps,
           decoder.description());
  return 0;
}

}  // namespace forge
