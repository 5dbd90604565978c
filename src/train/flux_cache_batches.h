// Which cached samples make up each micro-batch of a FLUX run that trains on a latent cache
// (flux.data_path, NOTE [FLUX latent cache] in ckpt/flux_latent_cache.h).
//
// NOTE [FLUX cache batches]
// Every sample of a micro-batch has the same latent size (one bucket, or several buckets of
// one latent size), so batches are drawn within groups of equal latent size. Epoch e:
//   each group's samples are shuffled (Fisher-Yates, Rng seeded by (seed, e, group)) and cut
//   into batches of `batch` samples in that order, the remainder left out of the epoch (a
//   partial batch would have another shape); then the epoch's batches, all groups together,
//   are shuffled (Rng seeded by (seed, e)).
// Micro-batch k of the run (k = step x gradient_accumulation_steps + micro) is batch k mod P
// of epoch k / P, P = the batches per epoch. So a micro-batch is a pure function of (seed,
// k): a resumed run reads from the step it resumes at with no data state of its own, and
// every sample appears once per epoch except each group's remainder, which differs from
// epoch to epoch. A cache whose every group holds fewer than `batch` samples is refused.
#pragma once

#include <cstdint>
#include <vector>

#include "ckpt/flux_latent_cache.h"

namespace forge {

struct FluxCacheBatch {
  int64_t latent_height = 0, latent_width = 0;
  std::vector<int64_t> samples;  // cache indices, `batch` of them
};

// NOTE [FLUX caption dropout]
// For classifier-free guidance, MLPerf's Flux.1 reference (torchtitan experiments/flux,
// training.classifer_free_guidance_prob = 0.1) trains each sample, with probability p, on the
// empty caption: with precomputed data, on the encodings of "" (T5's sequence, CLIP's pooled
// vector). forge: flux.caption_dropout_prob = p, and the cache's empty-prompt encodings
// (NOTE [FLUX latent cache]; forge prep --images writes them). Row r of micro-batch k drops
// its caption when Rng(derive_seed(derive_seed(seed, k), r + 1)).uniform() < p, each row
// independently: a pure function of (seed, k, r), so a resumed run drops what the
// uninterrupted one did. FluxLatentCache::read puts the empty encodings in those rows while it
// assembles the batch on the host. The validation loss never drops captions.
//
// caption_dropout_rows: per row of micro-batch k (rows of them), 1 where it drops; all 0 for p = 0.
std::vector<uint8_t> caption_dropout_rows(uint64_t seed, int64_t k, int64_t rows, double p);

class FluxCacheBatches {
 public:
  // Throws naming `what` (the config key) when no group has `batch` samples.
  FluxCacheBatches(const FluxCacheManifest& manifest, int64_t batch, uint64_t seed, const std::string& what);

  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  // The largest latent grid of any batch (the model's activations are planned for it).
  int64_t max_latent_tokens() const { return max_latent_tokens_; }
  // Micro-batch k of the run (NOTE [FLUX cache batches]).
  FluxCacheBatch at(int64_t k);

 private:
  struct Group {
    int64_t latent_height, latent_width;
    std::vector<int64_t> samples;
  };
  void build_epoch(int64_t epoch);

  std::vector<Group> groups_;
  int64_t batch_;
  uint64_t seed_;
  int64_t batches_per_epoch_ = 0, max_latent_tokens_ = 0;
  int64_t epoch_ = -1;
  std::vector<FluxCacheBatch> epoch_batches_;
};

}  // namespace forge
