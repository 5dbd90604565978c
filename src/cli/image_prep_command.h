// forge prep --images: a dataset of images with captions through the FLUX VAE (or pixel
// latents), T5 and CLIP, once, into a FLUX latent cache (NOTE [FLUX latent cache] in
// ckpt/flux_latent_cache.h) that FLUX runs train on.
#pragma once

#include <cstdint>
#include <string>

namespace CLI {
class App;
}

namespace forge {

struct ImagePrepOptions {
  std::string images;  // the dataset: a folder, or a .jsonl manifest
  std::string output;  // the cache folder
  bool overwrite = false;
  std::string layout;  // caption-files | filename-captions | jsonl; empty: jsonl for a file, else caption-files
  std::string missing_captions = "error";  // error | skip
  bool allow_empty_captions = false;
  std::string caption_extension = ".txt";
  int64_t resolution = 1024;
  std::string buckets = "square";  // square | aspect | a list WxH,...
  std::string crop;                // center | random; empty: center (NOTE [torchtitan's Flux.1 image transform])
  bool random_flip = false;
  uint64_t seed = 0;
  std::string pipeline;  // a FluxPipeline folder: vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/
  std::string vae;       // a FLUX VAE (diffusers folder or BFL's ae.safetensors), or "pixels"
  std::string t5, t5_tokenizer, clip, clip_tokenizer;
  int64_t text_tokens = 512;
  int64_t batch_size = 4;
  std::string device = "cpu";  // cpu | cuda
  std::string dtype = "bf16";  // bf16 | fp32: of the stored tensors
  int64_t shard_samples = 256;
  std::string latents = "mode";  // mode | distribution (NOTE [FLUX posterior latents])
  std::string transform = "diffusers";  // diffusers | torchtitan (data/image_transform.h)
  int64_t min_size = 0;                 // skip images narrower or lower than this; 0: keep all
};

// Registers --images and the image-only flags on `prep` (main.cpp's prep subcommand).
void add_image_prep_options(CLI::App& prep, ImagePrepOptions& options);
// The first image-only flag other than --images given to `prep` ("" when none): refused
// without --images.
std::string image_prep_flag_given(const CLI::App& prep);
// Whether `flag` ("--vae") is one of the image-only flags.
bool is_image_prep_flag(const std::string& flag);
int run_image_prep(const ImagePrepOptions& options);

}  // namespace forge
