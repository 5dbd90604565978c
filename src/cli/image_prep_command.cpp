// forge prep --images (image_prep_command.h): opens the dataset, places every image in its
// bucket from its header, loads the encoders, then per bucket decodes images in parallel
// (core/parallel.h), encodes them in batches and appends them to a FluxLatentCacheWriter,
// which renames the finished cache into place. Every flag is checked before anything is
// loaded; the encoders run in fp32 on the CPU and in bf16 on CUDA, as their own tests run
// them (the VAE's latents come out in fp32 either way; with --latents distribution its mean
// and logvar come in the encoders' dtype, FluxVae::encode_moments'). The empty caption "" is
// encoded once too, for caption dropout (NOTE [FLUX caption dropout]).
#include "cli/image_prep_command.h"

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>

#include "ckpt/flux_vae_weights.h"
#include "core/device.h"
#include "core/error.h"
#include "core/log.h"
#include "core/parallel.h"
#include "core/progress.h"
#include "ckpt/flux_latent_cache.h"
#include "data/image_caption_dataset.h"
#include "model/flux_vae.h"
#include "model/pixel_latents.h"
#include "ops/convert.h"
#include "train/flux_prompt_encoder.h"

namespace forge {

namespace fs = std::filesystem;

namespace {

// The image-only flags, for refusing them in text mode.
const char* const kImageFlags[] = {"--output",
                                   "--overwrite",
                                   "--layout",
                                   "--missing-captions",
                                   "--allow-empty-captions",
                                   "--caption-extension",
                                   "--resolution",
                                   "--buckets",
                                   "--crop",
                                   "--random-flip",
                                   "--seed",
                                   "--pipeline",
                                   "--vae",
                                   "--t5",
                                   "--t5-tokenizer",
                                   "--clip",
                                   "--clip-tokenizer",
                                   "--text-tokens",
                                   "--batch-size",
                                   "--device",
                                   "--dtype",
                                   "--shard-samples",
                                   "--latents",
                                   "--transform",
                                   "--min-size"};

bool has_file(const fs::path& folder, std::initializer_list<const char*> names) {
  std::error_code error;
  for (const char* name : names)
    if (fs::is_regular_file(folder / name, error)) return true;
  return false;
}

// The tokenizer beside an encoder given as `encoder`: its own folder when it holds tokenizer
// files, its `subfolder` (a pipeline folder), or the pipeline's `subfolder` beside it (an
// encoder given as PIPELINE/text_encoder_2).
std::string tokenizer_beside(const std::string& encoder, const char* subfolder,
                             std::initializer_list<const char*> files, const char* flag, const char* tokenizer_flag) {
  fs::path path(encoder);
  std::error_code error;
  if (!fs::is_directory(path, error)) path = path.parent_path();
  if (path.empty()) path = ".";
  for (const fs::path& candidate : {path, path / subfolder, path.parent_path() / subfolder})
    if (has_file(candidate, files)) return candidate.string();
  FORGE_FAIL("{} {}: no tokenizer beside it (looked in {}, {}/{} and {}/{}): give {} PATH", flag, encoder,
             path.string(), path.string(), subfolder, path.parent_path().string(), subfolder, tokenizer_flag);
}

struct Plan {
  ImageDatasetLayout layout;
  ImageDatasetOptions dataset;
  std::vector<ImageBucket> buckets;
  ImageTransform transform;
  std::string vae, t5, t5_tokenizer, clip, clip_tokenizer;
  Device device = Device::CPU;
  DType stored = DType::BF16;
};

void require_path(const std::string& path, const char* flag) {
  std::error_code error;
  if (!fs::exists(path, error)) FORGE_FAIL("{} {}: no such file or folder", flag, path);
}

Plan check_options(const ImagePrepOptions& o) {
  Plan p;
  if (o.images.empty())
    FORGE_FAIL("--images: give the dataset (a folder of images, a .jsonl manifest, or webdataset .tar shards)");
  // A brace pattern names tar shards; the dataset checks that each exists, naming the missing.
  const bool pattern = is_shard_pattern(o.images);
  if (!pattern) require_path(o.images, "--images");
  if (o.output.empty()) FORGE_FAIL("--images needs --output DIR: the folder the FLUX latent cache is written to");
  std::error_code error;
  const bool images_is_file = fs::is_regular_file(o.images, error);
  p.layout = !o.layout.empty()                       ? parse_image_dataset_layout(o.layout, "--layout")
             : pattern || o.images.ends_with(".tar") ? ImageDatasetLayout::Webdataset
             : images_is_file                        ? ImageDatasetLayout::Jsonl
                                                     : ImageDatasetLayout::CaptionFiles;
  if (pattern && p.layout != ImageDatasetLayout::Webdataset)
    FORGE_FAIL("--images {}: a brace pattern names tar shards, which --layout webdataset reads, not --layout {}",
               o.images, image_dataset_layout_name(p.layout));
  // webdataset takes a .tar file, a folder of them or a pattern (list_webdataset_shards).
  if (p.layout == ImageDatasetLayout::Jsonl && !images_is_file)
    FORGE_FAIL("--images {}: --layout jsonl takes the manifest file, not a folder", o.images);
  if (p.layout != ImageDatasetLayout::Jsonl && p.layout != ImageDatasetLayout::Webdataset && images_is_file)
    FORGE_FAIL("--images {}: --layout {} takes a folder of images (a .jsonl manifest is --layout jsonl)", o.images,
               image_dataset_layout_name(p.layout));
  if (o.missing_captions != "error" && o.missing_captions != "skip")
    FORGE_FAIL("--missing-captions '{}': expected error or skip", o.missing_captions);
  p.dataset.missing_captions = o.missing_captions == "skip" ? MissingCaptions::Skip : MissingCaptions::Error;
  p.dataset.allow_empty_captions = o.allow_empty_captions;
  if (o.caption_extension.size() < 2 || o.caption_extension[0] != '.' ||
      o.caption_extension.find('/') != std::string::npos)
    FORGE_FAIL("--caption-extension '{}': expected an extension such as .txt", o.caption_extension);
  p.dataset.caption_extension = o.caption_extension;

  if (o.resolution < 16 || o.resolution > 16384 || o.resolution % 16 != 0)
    FORGE_FAIL("--resolution {}: expected a multiple of 16 from 16 to 16384 (the VAE's 8x and the 2x2 patches)",
               o.resolution);
  const int resolution = static_cast<int>(o.resolution);
  if (o.buckets == "square") {
    p.buckets = {{resolution, resolution}};
  } else if (o.buckets == "aspect") {
    if (o.resolution % 64 != 0)
      FORGE_FAIL("--buckets aspect: --resolution {} must be a multiple of 64 (the buckets' step)", o.resolution);
    p.buckets = make_aspect_buckets(resolution);
  } else {
    p.buckets = parse_image_buckets(o.buckets, "--buckets (square, aspect, or a list such as 1024x1024,832x1216)");
  }

  if (!o.crop.empty() && o.crop != "center" && o.crop != "random")
    FORGE_FAIL("--crop '{}': expected center or random", o.crop);
  p.transform.kind = parse_image_transform_kind(o.transform, "--transform");
  p.transform.crop = o.crop == "random" || p.transform.kind == ImageTransformKind::Torchtitan ? ImageCrop::Random
                                                                                               : ImageCrop::Center;
  p.transform.random_flip = o.random_flip;
  p.transform.seed = o.seed;
  p.transform.min_size = o.min_size;
  check_image_transform(p.transform, p.buckets, !o.crop.empty());

  if (!o.pipeline.empty()) {
    require_path(o.pipeline, "--pipeline");
    if (!fs::is_directory(o.pipeline, error))
      FORGE_FAIL(
          "--pipeline {}: expected a FLUX pipeline folder (vae/, text_encoder/, text_encoder_2/, tokenizer/, "
          "tokenizer_2/)",
          o.pipeline);
  }
  const auto from = [&](const std::string& given, const char* subfolder, const char* flag) {
    if (!given.empty()) {
      if (given != "pixels" || std::string(flag) != "--vae") require_path(given, flag);
      return given;
    }
    if (o.pipeline.empty())
      FORGE_FAIL("{} is missing: give {} PATH, or --pipeline DIR holding {}/", flag, flag, subfolder);
    const fs::path sub = fs::path(o.pipeline) / subfolder;
    if (!fs::is_directory(sub, error))
      FORGE_FAIL("--pipeline {}: no {}/ in it (give {} PATH)", o.pipeline, subfolder, flag);
    return sub.string();
  };
  p.vae = from(o.vae, "vae", "--vae");
  p.t5 = from(o.t5, "text_encoder_2", "--t5");
  p.clip = from(o.clip, "text_encoder", "--clip");
  if (!o.t5_tokenizer.empty()) require_path(o.t5_tokenizer, "--t5-tokenizer");
  if (!o.clip_tokenizer.empty()) require_path(o.clip_tokenizer, "--clip-tokenizer");
  p.t5_tokenizer = !o.t5_tokenizer.empty() ? o.t5_tokenizer
                   : o.t5.empty()          ? (fs::path(o.pipeline) / "tokenizer_2").string()
                                  : tokenizer_beside(o.t5, "tokenizer_2", {"spiece.model", "tokenizer.json"}, "--t5",
                                                     "--t5-tokenizer");
  p.clip_tokenizer = !o.clip_tokenizer.empty() ? o.clip_tokenizer
                     : o.clip.empty()          ? (fs::path(o.pipeline) / "tokenizer").string()
                                               : tokenizer_beside(o.clip, "tokenizer", {"vocab.json", "tokenizer.json"},
                                                                  "--clip", "--clip-tokenizer");
  if (o.t5.empty() && o.t5_tokenizer.empty())
    require_path(p.t5_tokenizer, "--pipeline's tokenizer_2/ (--t5-tokenizer)");
  if (o.clip.empty() && o.clip_tokenizer.empty())
    require_path(p.clip_tokenizer, "--pipeline's tokenizer/ (--clip-tokenizer)");

  if (o.text_tokens < 1 || o.text_tokens > 4096)
    FORGE_FAIL("--text-tokens {}: expected T5 tokens per caption from 1 to 4096 (FLUX.1-dev: 512, schnell: 256)",
               o.text_tokens);
  if (o.batch_size < 1 || o.batch_size > 4096) FORGE_FAIL("--batch-size {}: expected 1 to 4096", o.batch_size);
  if (o.shard_samples < 1 || o.shard_samples > (int64_t{1} << 30))
    FORGE_FAIL("--shard-samples {}: expected a positive count of samples per shard file", o.shard_samples);
  if (o.device != "cpu" && o.device != "cuda") FORGE_FAIL("--device '{}': expected cpu or cuda", o.device);
  p.device = o.device == "cuda" ? Device::CUDA : Device::CPU;
  if (p.device == Device::CUDA && !cuda_available())
    FORGE_FAIL("--device cuda: no GPU is visible, or this build of forge has no CUDA backend");
  if (o.dtype != "bf16" && o.dtype != "fp32") FORGE_FAIL("--dtype '{}': expected bf16 or fp32", o.dtype);
  p.stored = o.dtype == "bf16" ? DType::BF16 : DType::F32;
  if (o.latents != "mode" && o.latents != "distribution")
    FORGE_FAIL("--latents '{}': expected mode (the VAE's mean, scaled) or distribution (its mean and logvar)",
               o.latents);
  if (o.latents == "distribution" && p.vae == "pixels")
    FORGE_FAIL("--latents distribution: --vae pixels has no posterior to sample (only a VAE has a mean and logvar)");
  return p;
}

// The encoders, loaded once: the VAE (or pixel latents) here, T5 and CLIP in a
// FluxPromptEncoder (NOTE [FLUX prompt encoding]).
struct Encoders {
  Device device = Device::CPU;
  DType dtype = DType::F32;
  std::unique_ptr<FluxVaeParameters> vae_params;
  std::unique_ptr<FluxVae> vae;  // none: pixel latents
  int64_t latent_channels = kPixelLatentChannels, factor = kPixelLatentFactor;
  std::unique_ptr<FluxPromptEncoder> prompts;

  Encoders(const Plan& p, int64_t tokens) : device(p.device) {
    dtype = device == Device::CUDA ? DType::BF16 : DType::F32;
    // The small files first, so that a bad one fails before the weights load: the VAE's
    // config here, the tokenizers and the text encoders' configs in FluxPromptEncoder.
    std::optional<FluxVaeConfig> config;
    if (p.vae != "pixels") {
      config = flux_vae_config_at(p.vae);
      if (config->in_channels != 3 || config->downsample_factor() != 8)
        FORGE_FAIL(
            "--vae {}: a VAE of {} input channels downsampling {}x; a FLUX latent cache holds an RGB VAE's "
            "latents at 1/8 of the image's side",
            p.vae, config->in_channels, config->downsample_factor());
    }
    prompts = std::make_unique<FluxPromptEncoder>(FluxPromptFiles{p.t5, p.t5_tokenizer, p.clip, p.clip_tokenizer},
                                                  device, tokens);
    if (config) {
      vae_params = load_flux_vae(p.vae, *config, device);
      vae = std::make_unique<FluxVae>(*vae_params);
      latent_channels = config->latent_channels;
      factor = 8;
    }
  }

  int64_t context_dim() const { return prompts->text_dim(); }
  int64_t pooled_dim() const { return prompts->pooled_dim(); }

  // images: fp32 host [n, 3, H, W] in [-1, 1]; returns latents [n, C, H/f, W/f], or with
  // `moments` the VAE's mean and logvar [n, 2 C, H/f, W/f] (NOTE [FLUX posterior latents]).
  Tensor encode_images(const Tensor& images, bool moments = false) {
    const int64_t n = images.dim(0), h = images.dim(2) / factor, w = images.dim(3) / factor;
    if (moments) {
      Tensor out = Tensor::empty({n, 2 * latent_channels, h, w}, dtype, device);
      vae->encode_moments(out, converted(images, device, dtype));
      return out;
    }
    if (!vae) {
      Tensor latents = Tensor::empty({n, kPixelLatentChannels, h, w});
      pixel_latents_encode(latents, images);
      return latents;
    }
    Tensor latents = Tensor::empty({n, latent_channels, h, w}, DType::F32, device);
    vae->encode(latents, converted(images, device, dtype));
    return latents;
  }

  // T5's prompt_embeds [n, text_tokens, d_model] and CLIP's pooled [n, hidden] of the
  // captions, in the encoders' dtype on their device.
  std::pair<Tensor, Tensor> encode_captions(const std::vector<std::string>& captions) {
    const int64_t n = static_cast<int64_t>(captions.size());
    Tensor text = Tensor::empty({n, prompts->text_tokens(), context_dim()}, dtype, device);
    Tensor pooled = Tensor::empty({n, pooled_dim()}, dtype, device);
    prompts->encode(captions, text, pooled);
    return {text, pooled};
  }
};

std::string describe_buckets(const std::vector<ImageBucket>& buckets) {
  std::string text;
  for (size_t i = 0; i < buckets.size() && i < 8; ++i) text += (i ? "," : "") + image_bucket_name(buckets[i]);
  if (buckets.size() > 8) text += fmt::format(",... ({} buckets)", buckets.size());
  return text;
}

}  // namespace

void add_image_prep_options(CLI::App& prep, ImagePrepOptions& o) {
  prep.add_option("--images", o.images,
                  "FLUX: prepare a latent cache from images with captions: a folder, a .jsonl manifest, or webdataset "
                  "tar shards (a .tar, a folder of them, or a pattern such as cc12m-train-{0000..2175}.tar); then "
                  "--output and the encoders; the text flags do not apply")
      ->type_name("DATASET");
  prep.add_option("--output", o.output, "images: the cache folder to write")->type_name("DIR");
  prep.add_flag("--overwrite", o.overwrite, "images: replace an existing cache at --output");
  prep.add_option("--layout", o.layout,
                  "images: caption-files (image + same-name .txt), filename-captions (the caption is the file name), "
                  "jsonl, or webdataset (tar shards of KEY.jpg + KEY.txt; default: webdataset for a .tar or a brace "
                  "pattern, jsonl for another file, else caption-files)");
  prep.add_option("--missing-captions", o.missing_captions, "images: error or skip images without a caption")
      ->capture_default_str();
  prep.add_flag("--allow-empty-captions", o.allow_empty_captions, "images: accept empty captions");
  prep.add_option("--caption-extension", o.caption_extension, "images, caption-files: the captions' extension")
      ->capture_default_str();
  prep.add_option("--resolution", o.resolution, "images: the square bucket's side, or the aspect buckets' scale")
      ->capture_default_str();
  prep.add_option("--buckets", o.buckets,
                  "images: square (resolution x resolution), aspect (kohya-style buckets of about resolution^2 "
                  "pixels) or a list such as 1024x1024,832x1216")
      ->capture_default_str();
  prep.add_option("--crop", o.crop,
                  "images: center (default) or random crop to the bucket (not with --transform torchtitan: random)");
  prep.add_flag("--random-flip", o.random_flip, "images: mirror each image with probability 1/2");
  prep.add_option("--seed", o.seed, "images: seed of the random crops and flips")->capture_default_str();
  prep.add_option("--pipeline", o.pipeline,
                  "images: a FLUX pipeline folder (vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/) "
                  "for every encoder not given on its own")
      ->type_name("DIR");
  prep.add_option("--vae", o.vae,
                  "images: the FLUX VAE (diffusers folder, pipeline folder or ae.safetensors), or "
                  "'pixels' (NOTE [Pixel latents])");
  prep.add_option("--t5", o.t5, "images: the T5 encoder (text_encoder_2/ or a pipeline folder)");
  prep.add_option("--t5-tokenizer", o.t5_tokenizer, "images: T5 tokenizer (default: beside --t5, or tokenizer_2/)");
  prep.add_option("--clip", o.clip, "images: the CLIP text encoder (text_encoder/ or a pipeline folder)");
  prep.add_option("--clip-tokenizer", o.clip_tokenizer,
                  "images: CLIP tokenizer (default: beside --clip, or tokenizer/)");
  prep.add_option("--text-tokens", o.text_tokens, "images: T5 tokens per caption")->capture_default_str();
  prep.add_option("--batch-size", o.batch_size, "images: images encoded at once")->capture_default_str();
  prep.add_option("--device", o.device, "images: cpu (fp32) or cuda (bf16) for the encoders")->capture_default_str();
  prep.add_option("--dtype", o.dtype, "images: bf16 or fp32, of the stored tensors")->capture_default_str();
  prep.add_option("--shard-samples", o.shard_samples, "images: samples per shard file at most (1 GiB at most too)")
      ->capture_default_str();
  prep.add_option("--latents", o.latents,
                  "images: mode (the VAE's mean, scaled) or distribution (its mean and logvar: training draws a "
                  "fresh latent per use, as MLPerf's Flux.1 reference)")
      ->capture_default_str();
  prep.add_option("--transform", o.transform,
                  "images: diffusers (diffusers' FLUX scripts: bilinear, any buckets) or torchtitan (MLPerf's Flux.1 "
                  "reference: bicubic, ceil, random crop, one square bucket)")
      ->capture_default_str();
  prep.add_option("--min-size", o.min_size,
                  "images: skip (and count) images whose width or height is below this; 0 keeps all")
      ->capture_default_str();
}

std::string image_prep_flag_given(const CLI::App& prep) {
  for (const char* flag : kImageFlags)
    if (prep.count(flag) > 0) return flag;
  return "";
}

bool is_image_prep_flag(const std::string& flag) {
  for (const char* known : kImageFlags)
    if (flag == known) return true;
  return false;
}

int run_image_prep(const ImagePrepOptions& o) {
  const auto started = std::chrono::steady_clock::now();
  const Plan plan = check_options(o);
  check_flux_cache_output(o.output, o.overwrite);

  const ImageCaptionDataset dataset(o.images, plan.layout, plan.dataset);
  log_info("prep: {}", dataset.describe());
  if (dataset.size() == 0) FORGE_FAIL("--images {}: no images with captions", o.images);

  // Every image's bucket from its header, less those under --min-size; the cache holds the
  // buckets in the list's order.
  std::vector<std::vector<size_t>> by_bucket(plan.buckets.size());
  size_t too_small = 0;
  std::string too_small_example;
  for (size_t i = 0; i < dataset.size(); ++i) {
    const ImageInfo& info = dataset.entry(i).info;
    if (image_too_small(info.width(), info.height(), plan.transform)) {
      if (too_small++ == 0)
        too_small_example = fmt::format("{} ({}x{})", dataset.entry(i).image_path, info.width(), info.height());
      continue;
    }
    by_bucket[nearest_bucket(info.width(), info.height(), plan.buckets)].push_back(i);
  }
  const size_t kept = dataset.size() - too_small;
  if (too_small > 0)
    log_info("prep: skipped {} of {} images under --min-size {} (width or height below it), such as {}", too_small,
             dataset.size(), o.min_size, too_small_example);
  if (kept == 0)
    FORGE_FAIL("--images {}: all {} images are under --min-size {} (width or height below it); nothing to prepare",
               o.images, dataset.size(), o.min_size);
  size_t used_buckets = 0;
  for (const auto& b : by_bucket) used_buckets += !b.empty();
  const std::string crop = plan.transform.crop == ImageCrop::Random ? "random" : "center";
  log_info("prep: transform {}; buckets {}; {} of them used; crop {}{}, seed {}",
           image_transform_kind_name(plan.transform.kind), describe_buckets(plan.buckets), used_buckets, crop,
           o.random_flip ? ", random flips" : "", o.seed);

  Encoders encoders(plan, o.text_tokens);
  log_info("prep: autoencoder {}, T5 {} (tokenizer {}), CLIP {} (tokenizer {}), {} tokens, on {} in {}; stored in {}",
           plan.vae, plan.t5, plan.t5_tokenizer, plan.clip, plan.clip_tokenizer, o.text_tokens, o.device,
           encoders.dtype == DType::BF16 ? "bf16" : "fp32", o.dtype);

  FluxCacheWriterOptions writer_options;
  writer_options.autoencoder = plan.vae == "pixels" ? "pixels" : "vae";
  writer_options.latent_channels = encoders.latent_channels;
  writer_options.text_tokens = o.text_tokens;
  writer_options.context_dim = encoders.context_dim();
  writer_options.pooled_dim = encoders.pooled_dim();
  writer_options.dtype = plan.stored;
  writer_options.max_shard_samples = o.shard_samples;
  writer_options.overwrite = o.overwrite;
  writer_options.latents = o.latents;
  if (encoders.vae) {  // shortest decimal of the VAE's float factors, as its config.json has them
    writer_options.scaling_factor = std::stod(fmt::format("{}", encoders.vae->config().scaling_factor));
    writer_options.shift_factor = std::stod(fmt::format("{}", encoders.vae->config().shift_factor));
  }
  std::vector<std::string> bucket_names;
  for (const ImageBucket& b : plan.buckets) bucket_names.push_back(image_bucket_name(b));
  writer_options.source = {{"tool", std::string("forge ") + FORGE_VERSION},
                           {"dataset", o.images},
                           {"layout", image_dataset_layout_name(plan.layout)},
                           {"resolution", o.resolution},
                           {"buckets", bucket_names},
                           {"transform", image_transform_kind_name(plan.transform.kind)},
                           {"crop", crop},
                           {"random_flip", o.random_flip},
                           {"seed", o.seed},
                           {"vae", plan.vae},
                           {"t5", plan.t5},
                           {"t5_tokenizer", plan.t5_tokenizer},
                           {"clip", plan.clip},
                           {"clip_tokenizer", plan.clip_tokenizer},
                           {"device", o.device},
                           {"min_size", o.min_size},
                           {"skipped_too_small", too_small}};
  FluxLatentCacheWriter writer(o.output, writer_options);
  {  // NOTE [FLUX caption dropout]: the empty caption, by the same encoders and settings.
    const auto [text, pooled] = encoders.encode_captions({""});
    writer.set_empty_prompt(text, pooled);
  }

  ProgressReporter progress(::isatty(STDERR_FILENO) != 0);
  progress.start(static_cast<double>(kept), "prep");
  const auto encode_start = std::chrono::steady_clock::now();
  int64_t done = 0;
  // Images are decoded in groups of whole batches, at least one image per thread.
  const int64_t group =
      ((std::max<int64_t>(num_threads(), o.batch_size) + o.batch_size - 1) / o.batch_size) * o.batch_size;
  for (size_t b = 0; b < plan.buckets.size(); ++b) {
    const ImageBucket bucket = plan.buckets[b];
    const std::vector<size_t>& members = by_bucket[b];
    for (size_t g = 0; g < members.size(); g += static_cast<size_t>(group)) {
      const int64_t count = std::min<int64_t>(group, static_cast<int64_t>(members.size() - g));
      Tensor images = Tensor::empty({count, 3, bucket.height, bucket.width});
      const int64_t image_numel = 3 * int64_t{bucket.height} * bucket.width;
      parallel_for(count, 1, [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) {
          const Tensor one = dataset.load(members[g + static_cast<size_t>(k)], bucket, plan.transform);
          std::copy(one.data<float>(), one.data<float>() + image_numel, images.data<float>() + k * image_numel);
        }
      });
      for (int64_t first = 0; first < count; first += o.batch_size) {
        const int64_t n = std::min(o.batch_size, count - first);
        std::vector<std::string> paths, captions;
        for (int64_t k = first; k < first + n; ++k) {
          const ImageCaptionEntry& entry = dataset.entry(members[g + static_cast<size_t>(k)]);
          paths.push_back(entry.image_path);
          captions.push_back(entry.caption);
        }
        const Tensor batch =
            Tensor::wrap(images.data<float>() + first * image_numel, {n, 3, bucket.height, bucket.width}, DType::F32);
        const Tensor latents = encoders.encode_images(batch, o.latents == "distribution");
        const auto [text, pooled] = encoders.encode_captions(captions);
        writer.append(bucket.width, bucket.height, latents, text, pooled, paths, captions);
        done += n;
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
        progress.update(static_cast<double>(done),
                        fmt::format("{} / {} images ({:.2f} images/s) | bucket {}", done, kept,
                                    done / std::max(seconds, 1e-9), image_bucket_name(bucket)));
      }
    }
  }
  progress.finish();
  const FluxCacheManifest manifest = writer.finish();
  const double encode_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  std::string per_bucket;
  for (size_t b = 0; b < plan.buckets.size(); ++b)
    if (!by_bucket[b].empty())
      per_bucket += fmt::format("{}{}: {}", per_bucket.empty() ? "" : ", ", image_bucket_name(plan.buckets[b]),
                                by_bucket[b].size());
  log_info("prep: {} images in {} bucket{} ({}), {} shard{}, {}{}", manifest.samples, used_buckets,
           used_buckets == 1 ? "" : "s", per_bucket, manifest.shards.size(), manifest.shards.size() == 1 ? "" : "s",
           format_bytes(static_cast<double>(writer.bytes_written())),
           too_small > 0 ? fmt::format("; {} images skipped under --min-size {}", too_small, o.min_size) : "");
  log_info("prep: {:.2f} s ({:.2f} s encoding: {:.2f} images/s); wrote {}", seconds, encode_seconds,
           static_cast<double>(manifest.samples) / std::max(encode_seconds, 1e-9), o.output);
  return 0;
}

}  // namespace forge
