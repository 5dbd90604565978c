// The FLUX latent cache: what `forge prep --images` computes once from images and captions
// (VAE latents, T5 text features, CLIP pooled vectors) and what FLUX runs train on
// (flux.data_path), so a run never touches an image or a text encoder.
//
// NOTE [FLUX latent cache]
// A folder holding
//   cache.json               the manifest:
//     {"format": "forge-flux-latent-cache", "version": 1,
//      "autoencoder": "vae" | "pixels",        the FLUX VAE's scaled latents (NOTE [FLUX VAE
//                                              latents]) or NOTE [Pixel latents]
//      "latent_channels": 16, "text_tokens": L, "context_dim": D, "pooled_dim": P,
//      "dtype": "bf16" | "fp32",               of every tensor in the shards
//      "latents": "mode" | "distribution",      optional, default "mode": what the shards hold
//      "scaling_factor": s, "shift_factor": h,  with "distribution" only: the VAE's
//      "empty_prompt": "empty-prompt.safetensors",  optional: the empty caption's encodings
//      "samples": N,
//      "shards": [{"file": "shard-00000.safetensors", "samples": n, "width": W, "height": H}, ...],
//      "source": {...}}                        how it was made (dataset, layout, encoders,
//                                              transform, buckets); informational
//   shard-NNNNN.safetensors  n samples that share one bucket W x H (pixels):
//     "latents"               [n, latent_channels, H/f, W/f]  f = 8 (vae) or 2 (pixels)
//     "prompt_embeds"         [n, L, D]    T5's last hidden state (FluxPipeline's prompt_embeds)
//     "pooled_prompt_embeds"  [n, P]       CLIP's pooler output (FluxPipeline's pooled_prompt_embeds)
//     with "latents": "distribution" (vae only), instead of "latents":
//     "latent_mean", "latent_logvar"  [n, latent_channels, H/8, W/8]  the VAE encoder's posterior
//                             as it gives it (diffusers' latent_dist.mean and .logvar: unscaled,
//                             logvar not clamped); read() scales them (NOTE [FLUX posterior latents])
//   empty-prompt.safetensors  when cache.json names it: "prompt_embeds" [1, L, D] and
//                            "pooled_prompt_embeds" [1, P] of the caption "" by the same encoders
//                            and settings, in the shards' dtype (NOTE [FLUX caption dropout])
//   captions.jsonl           one line per sample in cache order:
//                            {"shard": s, "row": r, "image": "path", "caption": "text"}
// Sample i of the cache is row i - (samples of the shards before it) of its shard, shards
// in the manifest's order. The tensor names are diffusers' (FluxPipeline.encode_prompt's
// outputs; latents as FluxPipeline feeds them to the transformer before packing), so a cache
// made with diffusers is the same files: scripts/flux_cache_from_diffusers.py writes one.
// Opening a cache checks the manifest's keys and every shard's tensors (names, dtypes,
// shapes against the manifest): a bad one names the file and key or tensor. The optional keys
// came after version 1 without bumping it: a cache without them reads as before.
//
// NOTE [FLUX posterior latents]
// MLPerf's Flux.1 reference (torchtitan experiments/flux) stores the VAE encoder's mean and
// logvar per image and draws a fresh latent whenever a sample is used. A "distribution" cache
// (forge prep --images --latents distribution) does the same: read() with noise eps gives
//   latents = (mean + exp(0.5 * clamp(logvar, -30, 20)) * eps - shift_factor) * scaling_factor
// (the clamp is diffusers' DiagonalGaussianDistribution's), and without noise the mode
//   latents = (mean - shift_factor) * scaling_factor,
// what a "mode" cache stores. Training draws eps per micro-batch from random_normal's
// counter-based stream (NOTE [FLUX runs]); the validation loss reads the mode (NOTE [FLUX
// validation loss]). Both are computed in fp32 from the stored values, then converted.
// The clamp: diffusers clamps logvar to [-30, 20] when it builds the distribution; torchtitan's
// autoencoder (BFL's DiagonalGaussian) samples exp(0.5 * logvar) unclamped. They differ only
// for a logvar outside [-30, 20], where std is below 3e-7 or above 2e4; forge clamps, as
// diffusers and FluxVae::encode do. The validation set: the reference encodes its images in
// evaluation with that same autoencoder, whose encode() samples (DiagonalGaussian's sample is
// on by default), so its validation loss carries fresh VAE noise at every evaluation; forge
// uses the mean instead, so that the validation loss is a fixed function of the weights (equal
// weights, equal loss) — the expected latent, not one draw of it.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "core/durable_directory.h"
#include "core/tensor.h"

namespace forge {

struct FluxCacheShard {
  std::string file;  // name inside the cache folder
  int64_t samples = 0;
  int64_t width = 0, height = 0;               // the bucket, pixels
  int64_t latent_width = 0, latent_height = 0;  // width / f, height / f
};

struct FluxCacheManifest {
  std::string autoencoder;  // "vae" | "pixels"
  int64_t latent_channels = 0, text_tokens = 0, context_dim = 0, pooled_dim = 0;
  DType dtype = DType::BF16;
  int64_t samples = 0;
  std::vector<FluxCacheShard> shards;
  std::string latents = "mode";  // "mode" | "distribution" (NOTE [FLUX posterior latents])
  double scaling_factor = 1.0, shift_factor = 0.0;  // "distribution": the VAE's
  std::string empty_prompt;  // the empty caption's file in the folder; "": the cache has none
  int64_t downsample_factor() const { return autoencoder == "pixels" ? 2 : 8; }
  bool distribution() const { return latents == "distribution"; }
  bool has_empty_prompt() const { return !empty_prompt.empty(); }
};

// How FluxLatentCache::read fills the rows it copies, besides copying them.
struct FluxCacheReadOptions {
  // Per row (or empty: none): nonzero gives that row the empty caption's text features and
  // pooled vector (the cache must have them: NOTE [FLUX caption dropout]).
  std::vector<uint8_t> empty_caption;
  // A distribution cache's eps: fp32 host [n, latent_channels, h, w] (NOTE [FLUX posterior
  // latents]); null: the mode. Refused for a mode cache.
  const Tensor* latent_noise = nullptr;
};

class FluxLatentCache {
 public:
  // Reads cache.json in `folder` and checks every shard it lists (NOTE [FLUX latent cache]).
  explicit FluxLatentCache(const std::string& folder);
  ~FluxLatentCache();
  FluxLatentCache(const FluxLatentCache&) = delete;
  FluxLatentCache& operator=(const FluxLatentCache&) = delete;

  const std::string& folder() const { return folder_; }
  const FluxCacheManifest& manifest() const { return manifest_; }
  int64_t size() const { return manifest_.samples; }
  // Sample i's shard index and row.
  std::pair<int64_t, int64_t> locate(int64_t i) const;

  // Copies the samples `indices` (each in [0, size()), all of one latent size: checked) into
  // latents [n, C, h, w], text [n, L, D] and pooled [n, P], n = indices.size(): tensors of
  // fp32 or bf16 on any device, converted from the cache's dtype.
  // `options` drop captions and sample latents (FluxCacheReadOptions).
  void read(const std::vector<int64_t>& indices, const Tensor& latents, const Tensor& text,
            const Tensor& pooled, const FluxCacheReadOptions& options = {}) const;

  struct Files;  // flux_latent_cache.cpp: the mapped shards

 private:
  std::string folder_;
  FluxCacheManifest manifest_;
  std::vector<int64_t> first_sample_;  // per shard
  std::unique_ptr<Files> files_;
};

// "forge-flux-latent-cache": cache.json's "format".
inline constexpr const char* kFluxCacheFormat = "forge-flux-latent-cache";
// The empty caption's file (NOTE [FLUX latent cache]).
inline constexpr const char* kFluxCacheEmptyPrompt = "empty-prompt.safetensors";

// The manifest `folder`/cache.json describes, checked key by key (NOTE [FLUX latent cache]);
// the shards are not opened. Throws a forge::Error naming the file and the key.
FluxCacheManifest read_flux_cache_manifest(const std::string& folder);

// Whether `folder` holds a cache.json whose "format" is kFluxCacheFormat (nothing else is
// checked): what may be overwritten.
bool is_flux_latent_cache(const std::string& folder);

// Throws unless a new cache may be written at `folder`: it is absent, an empty folder, or a
// cache (only cache.json, captions.jsonl, shard files and empty-prompt.safetensors in it) and `overwrite` is set. The
// writer checks this too; callers with slow work before it (loading encoders) check first.
void check_flux_cache_output(const std::string& folder, bool overwrite);

struct FluxCacheWriterOptions {
  std::string autoencoder = "vae";  // "vae" | "pixels"
  int64_t latent_channels = 16, text_tokens = 0, context_dim = 0, pooled_dim = 0;
  DType dtype = DType::BF16;  // of the stored tensors: BF16 or F32
  // A shard closes at this many samples, or before its stored tensors pass max_shard_bytes
  // (at least one sample a shard).
  int64_t max_shard_samples = 256;
  int64_t max_shard_bytes = int64_t{1} << 30;
  // Replace an existing cache at the folder (a folder holding anything else is never replaced).
  bool overwrite = false;
  nlohmann::json source = nlohmann::json::object();  // cache.json's "source"
  // "distribution": append() takes the VAE's moments [n, 2 latent_channels, h, w] (the mean,
  // then the logvar: FluxVae::encode_moments) and the shards hold latent_mean and
  // latent_logvar (NOTE [FLUX posterior latents]); autoencoder "vae" only.
  std::string latents = "mode";
  double scaling_factor = 1.0, shift_factor = 0.0;  // the VAE's, recorded for "distribution"
};

// Writes a cache (NOTE [FLUX latent cache]) into a temporary folder beside `folder`, renamed
// into place by finish() (NOTE [Durable files]); destroyed before finish() (an error), it
// removes the temporary folder and leaves whatever was at `folder` untouched. Samples
// are appended one bucket at a time: appending a bucket other than the open one writes the
// open one's last, partial shard, so callers group samples by bucket.
class FluxLatentCacheWriter {
 public:
  // Refuses (throws) an existing `folder` unless it is empty, or it is a cache (only
  // cache.json, captions.jsonl, shard files and empty-prompt.safetensors in it) and options.overwrite is set.
  FluxLatentCacheWriter(std::string folder, FluxCacheWriterOptions options);
  ~FluxLatentCacheWriter();
  FluxLatentCacheWriter(const FluxLatentCacheWriter&) = delete;
  FluxLatentCacheWriter& operator=(const FluxLatentCacheWriter&) = delete;

  // Appends n samples of the bucket width x height (pixels, multiples of 16): latents
  // [n, latent_channels, height / f, width / f], text [n, text_tokens, context_dim],
  // pooled [n, pooled_dim], fp32 or bf16 on any device; images and captions n strings each.
  void append(int64_t width, int64_t height, const Tensor& latents, const Tensor& text, const Tensor& pooled,
              const std::vector<std::string>& images, const std::vector<std::string>& captions);
  // The empty caption's encodings, text [1, text_tokens, context_dim] and pooled
  // [1, pooled_dim] (fp32 or bf16, any device), written to kFluxCacheEmptyPrompt by finish().
  void set_empty_prompt(const Tensor& text, const Tensor& pooled);
  // Writes the open shard, captions.jsonl and cache.json, checks the folder by opening it
  // (FluxLatentCache) and renames it into place. Throws when no sample was appended.
  FluxCacheManifest finish();

  int64_t samples() const { return manifest_.samples; }
  int64_t shards() const { return static_cast<int64_t>(manifest_.shards.size()); }
  // Bytes of shard files written so far.
  int64_t bytes_written() const { return bytes_written_; }
  const std::string& folder() const { return directory_.path(); }

 private:
  void write_open_shard();

  FluxCacheWriterOptions options_;
  AtomicDirectory directory_;
  FluxCacheManifest manifest_;
  std::string captions_;  // captions.jsonl so far (written shards)
  int64_t bytes_written_ = 0;
  bool finished_ = false;
  // The open shard.
  int64_t open_width_ = 0, open_height_ = 0, open_samples_ = 0;
  std::vector<float> latents_, text_, pooled_;
  std::vector<std::string> images_, open_captions_;
  std::vector<float> logvar_;                     // "distribution": the open shard's logvar
  std::vector<float> empty_text_, empty_pooled_;  // set_empty_prompt's; empty: none
};

}  // namespace forge
