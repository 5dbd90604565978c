// NOTE [FLUX cache batches]: micro-batches of one latent size, every sample once per epoch
// (bar each group's remainder), a pure function of (seed, k), and refusals.
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/error.h"
#include "train/flux_cache_batches.h"

namespace forge {
namespace {

FluxCacheManifest manifest() {
  FluxCacheManifest m;
  m.autoencoder = "vae";
  m.latent_channels = 16;
  // 7 samples at 64x64 in two shards, 5 at 48x80, 2 at 32x32.
  m.shards = {{"a", 4, 512, 512, 64, 64}, {"b", 5, 640, 384, 80, 48}, {"c", 3, 512, 512, 64, 64},
              {"d", 2, 256, 256, 32, 32}};
  m.samples = 14;
  return m;
}

TEST(FluxCacheBatches, EachEpochDrawsEverySampleOnceWithinItsLatentSize) {
  const FluxCacheManifest m = manifest();
  FluxCacheBatches batches(m, 2, 7, "flux.data_path");
  EXPECT_EQ(batches.batches_per_epoch(), 3 + 2 + 1);  // 7 / 2, 5 / 2, 2 / 2
  EXPECT_EQ(batches.max_latent_tokens(), 32 * 32);
  auto size_of = [](int64_t i) { return i < 4 || (i >= 9 && i < 12) ? 64 : i < 9 ? 48 : 32; };
  std::set<std::vector<int64_t>> orders;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::map<int64_t, int> seen;
    std::vector<int64_t> order;
    for (int64_t j = 0; j < batches.batches_per_epoch(); ++j) {
      const FluxCacheBatch b = batches.at(epoch * batches.batches_per_epoch() + j);
      ASSERT_EQ(b.samples.size(), 2u);
      for (const int64_t i : b.samples) {
        EXPECT_EQ(size_of(i), b.latent_height) << i;
        ++seen[i];
        order.push_back(i);
      }
    }
    EXPECT_EQ(seen.size(), 12u);  // 14 less one remainder of the 7 and one of the 5
    for (const auto& [i, count] : seen) EXPECT_EQ(count, 1) << i;
    orders.insert(order);
  }
  EXPECT_EQ(orders.size(), 3u);  // epochs differ
}

TEST(FluxCacheBatches, AMicroBatchIsAPureFunctionOfSeedAndIndex) {
  FluxCacheBatches a(manifest(), 3, 11, "x"), b(manifest(), 3, 11, "x"), other(manifest(), 3, 12, "x");
  bool differs = false;
  for (const int64_t k : {9, 0, 4, 17, 3}) {  // out of order: epochs rebuilt on demand
    EXPECT_EQ(a.at(k).samples, b.at(k).samples) << k;
    differs |= a.at(k).samples != other.at(k).samples;
  }
  EXPECT_TRUE(differs);
}

TEST(FluxCacheBatches, RefusesACacheWithoutAWholeBatch) {
  try {
    FluxCacheBatches(manifest(), 8, 1, "flux.data_path /c");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("flux.data_path /c"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("8 samples"), std::string::npos) << e.what();
  }
  EXPECT_THROW(FluxCacheBatches(manifest(), 0, 1, "x"), Error);
}

}  // namespace
}  // namespace forge
