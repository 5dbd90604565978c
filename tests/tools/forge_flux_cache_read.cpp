// Test tool: opens a FLUX latent cache with FluxLatentCache (every check of NOTE [FLUX latent
// cache]) and reads every sample back, for tests/python/test_flux_prep_vs_diffusers.py.
//
//   forge_flux_cache_read CACHE OUT   writes OUT/latents.bin, OUT/prompt_embeds.bin and
//                                     OUT/pooled_prompt_embeds.bin: every sample's rows in
//                                     cache order as fp32 (read one sample at a time, and
//                                     each shard's samples again as one read in reverse
//                                     order, which must agree), and OUT/manifest.json
// Errors go to stderr with exit status 1.
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "ckpt/flux_latent_cache.h"

using namespace forge;

int main(int argc, char** argv) try {
  if (argc != 3) {
    std::cerr << "usage: forge_flux_cache_read CACHE OUT\n";
    return 2;
  }
  const FluxLatentCache cache(argv[1]);
  const FluxCacheManifest& m = cache.manifest();
  const std::string out = argv[2];
  std::ofstream files[3] = {std::ofstream(out + "/latents.bin", std::ios::binary),
                            std::ofstream(out + "/prompt_embeds.bin", std::ios::binary),
                            std::ofstream(out + "/pooled_prompt_embeds.bin", std::ios::binary)};
  int64_t first = 0;
  for (const FluxCacheShard& shard : m.shards) {
    const int64_t n = shard.samples;
    Tensor latents = Tensor::empty({n, m.latent_channels, shard.latent_height, shard.latent_width});
    Tensor text = Tensor::empty({n, m.text_tokens, m.context_dim}), pooled = Tensor::empty({n, m.pooled_dim});
    std::vector<int64_t> reversed;
    for (int64_t i = n - 1; i >= 0; --i) reversed.push_back(first + i);
    cache.read(reversed, latents, text, pooled);
    for (int64_t i = 0; i < n; ++i) {
      Tensor l = Tensor::empty({1, m.latent_channels, shard.latent_height, shard.latent_width});
      Tensor t = Tensor::empty({1, m.text_tokens, m.context_dim}), p = Tensor::empty({1, m.pooled_dim});
      cache.read({first + i}, l, t, p);
      const Tensor singles[3] = {l, t, p}, batch[3] = {latents, text, pooled};
      for (int k = 0; k < 3; ++k) {
        const size_t bytes = singles[k].nbytes();
        FORGE_CHECK(
            std::memcmp(singles[k].raw(), static_cast<const char*>(batch[k].raw()) + (n - 1 - i) * bytes, bytes) == 0,
            "sample {}: one read and the shard's read differ", first + i);
        files[k].write(static_cast<const char*>(singles[k].raw()), static_cast<std::streamsize>(bytes));
      }
    }
    first += n;
  }
  nlohmann::json shards = nlohmann::json::array();
  for (const FluxCacheShard& s : m.shards)
    shards.push_back({{"file", s.file},
                      {"samples", s.samples},
                      {"width", s.width},
                      {"height", s.height},
                      {"latent_width", s.latent_width},
                      {"latent_height", s.latent_height}});
  std::ofstream(out + "/manifest.json")
      << nlohmann::json{{"autoencoder", m.autoencoder}, {"samples", m.samples},       {"text_tokens", m.text_tokens},
                        {"context_dim", m.context_dim}, {"pooled_dim", m.pooled_dim}, {"shards", shards}}
             .dump();
  return 0;
} catch (const std::exception& e) {
  std::cerr << "forge_flux_cache_read: " << e.what() << "\n";
  return 1;
}
