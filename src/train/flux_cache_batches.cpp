// The micro-batches of a FLUX run on a latent cache; see flux_cache_batches.h.
#include "train/flux_cache_batches.h"

#include <algorithm>
#include <map>
#include <utility>

#include "core/error.h"
#include "core/rng.h"

namespace forge {
namespace {

template <typename T> void shuffle(std::vector<T>& items, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = items.size(); i > 1; --i) std::swap(items[i - 1], items[rng.below(i)]);
}

}  // namespace

FluxCacheBatches::FluxCacheBatches(const FluxCacheManifest& manifest, int64_t batch, uint64_t seed,
                                   const std::string& what)
    : batch_(batch), seed_(seed) {
  FORGE_CHECK(batch > 0, "{}: a micro-batch needs at least one sample, got {}", what, batch);
  std::map<std::pair<int64_t, int64_t>, size_t> group_of;  // (h, w) -> index, in first-seen order
  int64_t first = 0;
  for (const FluxCacheShard& shard : manifest.shards) {
    const auto key = std::make_pair(shard.latent_height, shard.latent_width);
    auto [it, added] = group_of.emplace(key, groups_.size());
    if (added) groups_.push_back({shard.latent_height, shard.latent_width, {}});
    std::vector<int64_t>& samples = groups_[it->second].samples;
    for (int64_t r = 0; r < shard.samples; ++r) samples.push_back(first + r);
    first += shard.samples;
  }
  std::string sizes;
  for (const Group& g : groups_) {
    const int64_t batches = static_cast<int64_t>(g.samples.size()) / batch;
    batches_per_epoch_ += batches;
    if (batches > 0) max_latent_tokens_ = std::max(max_latent_tokens_, g.latent_height * g.latent_width / 4);
    sizes += fmt::format("{}{} at {}x{}", sizes.empty() ? "" : ", ", g.samples.size(), g.latent_width,
                         g.latent_height);
  }
  FORGE_CHECK(batches_per_epoch_ > 0,
              "{}: no latent size has a whole micro-batch of {} samples (the cache holds {}); lower "
              "training.local_batch_size or prepare more images",
              what, batch, sizes.empty() ? std::string("no samples") : sizes);
}

void FluxCacheBatches::build_epoch(int64_t epoch) {
  epoch_batches_.clear();
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<int64_t> order = groups_[g].samples;
    shuffle(order, derive_seed(derive_seed(seed_, static_cast<uint64_t>(epoch)), g + 1));
    for (size_t b = 0; b + static_cast<size_t>(batch_) <= order.size(); b += static_cast<size_t>(batch_))
      epoch_batches_.push_back({groups_[g].latent_height, groups_[g].latent_width,
                                std::vector<int64_t>(order.begin() + static_cast<std::ptrdiff_t>(b),
                                                     order.begin() + static_cast<std::ptrdiff_t>(b) + batch_)});
  }
  shuffle(epoch_batches_, derive_seed(derive_seed(seed_, static_cast<uint64_t>(epoch)), 0));
  epoch_ = epoch;
}

FluxCacheBatch FluxCacheBatches::at(int64_t k) {
  FORGE_CHECK(k >= 0, "micro-batch {} of a run", k);
  const int64_t epoch = k / batches_per_epoch_;
  if (epoch != epoch_) build_epoch(epoch);
  return epoch_batches_[static_cast<size_t>(k % batches_per_epoch_)];
}

std::vector<uint8_t> caption_dropout_rows(uint64_t seed, int64_t k, int64_t rows, double p) {
  FORGE_CHECK(k >= 0 && rows >= 0 && p >= 0 && p <= 1, "caption dropout: micro-batch {}, {} rows, p {}", k, rows, p);
  std::vector<uint8_t> dropped(static_cast<size_t>(rows), 0);
  if (p == 0) return dropped;
  const uint64_t batch_seed = derive_seed(seed, static_cast<uint64_t>(k));
  for (int64_t r = 0; r < rows; ++r)
    dropped[static_cast<size_t>(r)] = Rng(derive_seed(batch_seed, static_cast<uint64_t>(r) + 1)).uniform() < p;
  return dropped;
}

}  // namespace forge
