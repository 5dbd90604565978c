// The FLUX latent cache's empty caption (NOTE [FLUX caption dropout]) and posterior latents
// (NOTE [FLUX posterior latents]): written, opened and read back; dropped rows hold the empty
// caption's encodings exactly and the others what a plain read gives; a distribution cache's
// read is (mean + exp(0.5 clamp(logvar, -30, 20)) eps - shift) scale computed here on its
// own, and its mode without noise; what is refused. And the dropout draw: a pure function of
// (seed, micro-batch, row) whose rate stays within a binomial bound of p.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "ckpt/flux_latent_cache.h"
#include "cli/config.h"
#include "ckpt/safetensors.h"
#include "core/bf16.h"
#include "core/rng.h"
#include "expect_error.h"
#include "ops/convert.h"
#include "test_data_temp_dir.h"
#include "train/flux_cache_batches.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Values that identify their sample and position.
Tensor pattern(Shape shape, int64_t first_sample, float kind) {
  Tensor t = Tensor::empty(shape);
  const int64_t row = t.numel() / shape[0];
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data<float>()[i] =
        kind + 100.0f * static_cast<float>(first_sample + i / row) + 0.25f * static_cast<float>(i % row);
  return t;
}

FluxCacheWriterOptions options(DType dtype = DType::F32) {
  FluxCacheWriterOptions o;
  o.latent_channels = 16;
  o.text_tokens = 3;
  o.context_dim = 4;
  o.pooled_dim = 5;
  o.dtype = dtype;
  o.max_shard_samples = 2;
  return o;
}

std::vector<std::string> names(int64_t first, int64_t n) {
  std::vector<std::string> out;
  for (int64_t i = 0; i < n; ++i) out.push_back("s" + std::to_string(first + i));
  return out;
}

// 4 samples of 16x16 with (or without) the empty caption's encodings -7 - 0.5 i, -9 - i.
std::string write_with_empty_prompt(const TempDir& dir, const std::string& name, bool empty_prompt,
                                    DType dtype = DType::F32) {
  const std::string folder = dir.file(name);
  FluxLatentCacheWriter writer(folder, options(dtype));
  writer.append(16, 16, pattern({4, 16, 2, 2}, 0, 0.0f), pattern({4, 3, 4}, 0, 0.5f), pattern({4, 5}, 0, 0.125f),
                names(0, 4), names(0, 4));
  if (empty_prompt) {
    Tensor text = Tensor::empty({1, 3, 4}), pooled = Tensor::empty({1, 5});
    for (int64_t i = 0; i < 12; ++i) text.data<float>()[i] = -7.0f - 0.5f * static_cast<float>(i);
    for (int64_t i = 0; i < 5; ++i) pooled.data<float>()[i] = -9.0f - static_cast<float>(i);
    writer.set_empty_prompt(text, pooled);
  }
  writer.finish();
  return folder;
}

Tensor as_f32(const Tensor& t) { return converted(t, Device::CPU, DType::F32); }

bool same_bytes(const Tensor& a, const Tensor& b) { return std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0; }

TEST(FluxCacheEmptyPrompt, DroppedRowsHoldTheEmptyCaptionExactly) {
  TempDir dir;
  for (const DType stored : {DType::F32, DType::BF16}) {
    const std::string folder =
        write_with_empty_prompt(dir, std::string("c-") + std::string(dtype_name(stored)), true, stored);
    {
      std::ifstream in(folder + "/cache.json");
      EXPECT_EQ(json::parse(in)["empty_prompt"], kFluxCacheEmptyPrompt);
    }
    EXPECT_TRUE(fs::is_regular_file(folder + "/" + kFluxCacheEmptyPrompt));
    const FluxLatentCache cache(folder);
    EXPECT_TRUE(cache.manifest().has_empty_prompt());
    for (const DType into : {DType::F32, DType::BF16}) {
      const std::vector<int64_t> rows = {3, 1, 0};
      Tensor l = Tensor::empty({3, 16, 2, 2}, into), t = Tensor::empty({3, 3, 4}, into),
             p = Tensor::empty({3, 5}, into);
      Tensor l0 = Tensor::empty({3, 16, 2, 2}, into), t0 = Tensor::empty({3, 3, 4}, into),
             p0 = Tensor::empty({3, 5}, into);
      cache.read(rows, l0, t0, p0);
      // p = 0 (no flags, or all zero) reads exactly what a plain read does.
      FluxCacheReadOptions none;
      none.empty_caption = {0, 0, 0};
      cache.read(rows, l, t, p, none);
      EXPECT_TRUE(same_bytes(l, l0) && same_bytes(t, t0) && same_bytes(p, p0));
      FluxCacheReadOptions drop;
      drop.empty_caption = {1, 0, 1};
      cache.read(rows, l, t, p, drop);
      EXPECT_TRUE(same_bytes(l, l0)) << "the latents are not the caption's";
      const Tensor tf = as_f32(t), pf = as_f32(p), t0f = as_f32(t0),
                   p0f = as_f32(p0);
      for (const int64_t r : {0, 2}) {
        for (int64_t i = 0; i < 12; ++i)
          EXPECT_EQ(tf.data<float>()[r * 12 + i], to_float(to_bf16(-7.0f - 0.5f * static_cast<float>(i))));
        for (int64_t i = 0; i < 5; ++i)
          EXPECT_EQ(pf.data<float>()[r * 5 + i], to_float(to_bf16(-9.0f - static_cast<float>(i))));
      }
      for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(tf.data<float>()[12 + i], t0f.data<float>()[12 + i]);
      for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(pf.data<float>()[5 + i], p0f.data<float>()[5 + i]);
    }
  }
}

TEST(FluxCacheEmptyPrompt, ACacheWithoutItReadsAsBeforeAndRefusesDropping) {
  TempDir dir;
  const std::string folder = write_with_empty_prompt(dir, "plain", false);
  {
    std::ifstream in(folder + "/cache.json");
    EXPECT_FALSE(json::parse(in).contains("empty_prompt"));
  }
  const FluxLatentCache cache(folder);
  EXPECT_FALSE(cache.manifest().has_empty_prompt());
  Tensor l = Tensor::empty({2, 16, 2, 2}), t = Tensor::empty({2, 3, 4}), p = Tensor::empty({2, 5});
  FluxCacheReadOptions drop;
  drop.empty_caption = {0, 1};
  expect_error([&] { cache.read({0, 1}, l, t, p, drop); }, {"plain", "no empty caption"});
  drop.empty_caption = {1};
  const std::string with = write_with_empty_prompt(dir, "with", true);
  expect_error([&] { FluxLatentCache(with).read({0, 1}, l, t, p, drop); }, {"1 empty-caption flags", "2 samples"});
}

TEST(FluxCacheEmptyPrompt, BadEmptyPromptFilesAreRefused) {
  TempDir dir;
  const std::string folder = write_with_empty_prompt(dir, "c", true);
  const std::string path = folder + "/" + kFluxCacheEmptyPrompt;
  std::vector<float> v(64, 0.0f);
  const auto F32 = SafetensorsDType::F32;
  const std::vector<std::pair<std::vector<SafetensorsTensorRef>, std::vector<std::string>>> cases = {
      {{{"prompt_embeds", {1, 3, 4}, v.data()}}, {"no tensor \"pooled_prompt_embeds\""}},
      {{{"prompt_embeds", {2, 3, 4}, v.data()}, {"pooled_prompt_embeds", {1, 5}, v.data()}},
       {"\"prompt_embeds\"", "[1, 3, 4]"}},
      {{{"prompt_embeds", {1, 3, 4}, v.data()}, {"pooled_prompt_embeds", {1, 5}, v.data()}, {"x", {1}, v.data()}},
       {"tensor \"x\""}},
  };
  fs::copy_file(path, path + ".bak");
  for (const auto& [tensors, fragments] : cases) {
    write_safetensors(path, tensors, F32, {});
    std::vector<std::string> all = fragments;
    all.push_back(kFluxCacheEmptyPrompt);
    expect_error([&] { FluxLatentCache cache(folder); }, all);
  }
  fs::remove(path);
  expect_error([&] { FluxLatentCache cache(folder); }, {kFluxCacheEmptyPrompt, "missing", "\"empty_prompt\""});
  fs::rename(path + ".bak", path);
  EXPECT_EQ(FluxLatentCache(folder).size(), 4);
  // A cache with the file may be overwritten (it is one of a cache's files).
  FluxCacheWriterOptions o = options();
  o.overwrite = true;
  FluxLatentCacheWriter again(folder, o);
  again.append(16, 16, pattern({1, 16, 2, 2}, 0, 0), pattern({1, 3, 4}, 0, 0), pattern({1, 5}, 0, 0), {"a"}, {"b"});
  again.finish();
  EXPECT_FALSE(fs::exists(path));
}

// The moments of sample i: mean 0.01 (i, position) pattern, logvar spread over [-40, 30] so
// that both clamp ends are hit.
Tensor moments(int64_t first, int64_t n, int64_t h, int64_t w) {
  Tensor t = Tensor::empty({n, 32, h, w});
  const int64_t plane = 16 * h * w;
  for (int64_t s = 0; s < n; ++s)
    for (int64_t e = 0; e < plane; ++e) {
      t.data<float>()[s * 2 * plane + e] = 0.01f * static_cast<float>((first + s) * 37 + e) - 1.0f;
      t.data<float>()[s * 2 * plane + plane + e] = -40.0f + 70.0f * static_cast<float>((e * 7 + s) % plane) / plane;
    }
  return t;
}

std::string write_distribution(const TempDir& dir, DType dtype) {
  const std::string folder = dir.file(std::string("posterior-") + std::string(dtype_name(dtype)));
  FluxCacheWriterOptions o = options(dtype);
  o.latents = "distribution";
  o.scaling_factor = 0.3611;
  o.shift_factor = 0.1159;
  FluxLatentCacheWriter writer(folder, o);
  writer.append(32, 16, moments(0, 3, 2, 4), pattern({3, 3, 4}, 0, 0.5f), pattern({3, 5}, 0, 0.125f), names(0, 3),
                names(0, 3));
  writer.finish();
  return folder;
}

TEST(FluxCachePosterior, RoundTripsAndSamplesAsTheFormulaSays) {
  TempDir dir;
  for (const DType stored : {DType::F32, DType::BF16}) {
    const std::string folder = write_distribution(dir, stored);
    {
      std::ifstream in(folder + "/cache.json");
      const json j = json::parse(in);
      EXPECT_EQ(j["latents"], "distribution");
      EXPECT_EQ(j["scaling_factor"], 0.3611);
      EXPECT_EQ(j["shift_factor"], 0.1159);
    }
    const SafetensorsFile shard(folder + "/shard-00000.safetensors");
    EXPECT_NE(shard.find("latent_mean"), nullptr);
    EXPECT_NE(shard.find("latent_logvar"), nullptr);
    EXPECT_EQ(shard.find("latents"), nullptr);
    const FluxLatentCache cache(folder);
    ASSERT_TRUE(cache.manifest().distribution());
    const std::vector<int64_t> rows = {2, 0};
    const Tensor stored_moments = moments(0, 3, 2, 4);
    const int64_t plane = 16 * 2 * 4;
    Tensor eps = Tensor::empty({2, 16, 2, 4});
    Rng rng(5);
    for (int64_t i = 0; i < eps.numel(); ++i) eps.data<float>()[i] = static_cast<float>(rng.normal());
    const auto round = [&](float x) { return stored == DType::BF16 ? to_float(to_bf16(x)) : x; };
    for (const DType into : {DType::F32, DType::BF16}) {
      Tensor l = Tensor::empty({2, 16, 2, 4}, into), mode = Tensor::empty({2, 16, 2, 4}, into),
             t = Tensor::empty({2, 3, 4}, into), p = Tensor::empty({2, 5}, into);
      FluxCacheReadOptions sample;
      sample.latent_noise = &eps;
      cache.read(rows, l, t, p, sample);
      cache.read(rows, mode, t, p);
      const Tensor lf = as_f32(l), mf = as_f32(mode);
      for (int64_t k = 0; k < 2; ++k)
        for (int64_t e = 0; e < plane; ++e) {
          const int64_t s = rows[static_cast<size_t>(k)];
          const double mean = round(stored_moments.data<float>()[s * 2 * plane + e]);
          const double logvar = round(stored_moments.data<float>()[s * 2 * plane + plane + e]);
          const double std = std::exp(0.5 * std::min(std::max(logvar, -30.0), 20.0));
          const double want = (mean + std * eps.data<float>()[k * plane + e] - 0.1159) * 0.3611;
          const double want_mode = (mean - 0.1159) * 0.3611;
          const double tolerance = into == DType::BF16 ? 8e-3 : 2e-6;
          EXPECT_NEAR(lf.data<float>()[k * plane + e], want, tolerance * (1 + std::abs(want))) << k << " " << e;
          EXPECT_NEAR(mf.data<float>()[k * plane + e], want_mode, tolerance * (1 + std::abs(want_mode)));
        }
    }
  }
}

TEST(FluxCachePosterior, RefusesWhatDoesNotFit) {
  TempDir dir;
  const std::string folder = write_distribution(dir, DType::F32);
  const FluxLatentCache cache(folder);
  Tensor l = Tensor::empty({1, 16, 2, 4}), t = Tensor::empty({1, 3, 4}), p = Tensor::empty({1, 5});
  Tensor wrong = Tensor::empty({1, 16, 4, 2}), bf16 = Tensor::empty({1, 16, 2, 4}, DType::BF16);
  FluxCacheReadOptions sample;
  sample.latent_noise = &wrong;
  expect_error([&] { cache.read({0}, l, t, p, sample); }, {"latent noise"});
  sample.latent_noise = &bf16;
  expect_error([&] { cache.read({0}, l, t, p, sample); }, {"fp32 on the host"});
  // Noise for a mode cache.
  const std::string mode = write_with_empty_prompt(dir, "mode", true);
  Tensor eps = Tensor::empty({1, 16, 2, 2}), ml = Tensor::empty({1, 16, 2, 2});
  sample.latent_noise = &eps;
  expect_error([&] { FluxLatentCache(mode).read({0}, ml, t, p, sample); }, {"fixed latents"});
  // The shards of a distribution cache hold the moments, not latents.
  const std::string shard = folder + "/shard-00000.safetensors";
  std::vector<float> v(512, 0.0f);
  write_safetensors(shard,
                    {{"latents", {2, 16, 2, 4}, v.data()},
                     {"prompt_embeds", {2, 3, 4}, v.data()},
                     {"pooled_prompt_embeds", {2, 5}, v.data()}},
                    SafetensorsDType::F32, {});
  expect_error([&] { FluxLatentCache c(folder); }, {"shard-00000.safetensors", "tensor \"latents\""});
  // A distribution of pixel latents; the writer's moments shape.
  FluxCacheWriterOptions pixels = options();
  pixels.autoencoder = "pixels";
  pixels.latents = "distribution";
  expect_error([&] { FluxLatentCacheWriter w(dir.file("pixels"), pixels); }, {"distribution", "pixels"});
  FluxCacheWriterOptions o = options();
  o.latents = "distribution";
  FluxLatentCacheWriter w(dir.file("shape"), o);
  expect_error([&] { w.append(16, 16, pattern({1, 16, 2, 2}, 0, 0), t, p, {"a"}, {"b"}); }, {"VAE moments"});
}

TEST(FluxCaptionDropout, IsAPureFunctionOfSeedBatchAndRow) {
  const std::vector<uint8_t> a = caption_dropout_rows(11, 5, 64, 0.5), b = caption_dropout_rows(11, 5, 64, 0.5);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, caption_dropout_rows(12, 5, 64, 0.5));
  EXPECT_NE(a, caption_dropout_rows(11, 6, 64, 0.5));
  // A row's draw does not depend on how many rows follow it.
  const std::vector<uint8_t> shorter = caption_dropout_rows(11, 5, 10, 0.5);
  EXPECT_TRUE(std::equal(shorter.begin(), shorter.end(), a.begin()));
  EXPECT_EQ(caption_dropout_rows(11, 5, 64, 0.0), std::vector<uint8_t>(64, 0));
  EXPECT_EQ(caption_dropout_rows(11, 5, 64, 1.0), std::vector<uint8_t>(64, 1));
}

TEST(FluxCaptionDropout, RateIsWithinABinomialBound) {
  for (const double p : {0.1, 0.5}) {
    int64_t dropped = 0, total = 0;
    for (int64_t k = 0; k < 5000; ++k)
      for (const uint8_t d : caption_dropout_rows(3, k, 4, p)) {
        dropped += d;
        ++total;
      }
    // 6 standard deviations of Binomial(total, p).
    const double bound = 6 * std::sqrt(total * p * (1 - p));
    EXPECT_NEAR(static_cast<double>(dropped), total * p, bound) << "p " << p;
  }
}

// flux.caption_dropout_prob: in [0, 1], a FLUX run's, and only on a latent cache.
TEST(FluxCaptionDropout, ConfigIsValidated) {
  const std::string experiment =
      (fs::path(FORGE_TEST_DATA_DIR).parent_path().parent_path() / "configs/experiments/cpu/flux-debug.yaml").string();
  EXPECT_EQ(load_experiment(experiment, {}).flux.caption_dropout_prob, 0.0);
  expect_error([&] { load_experiment(experiment, {{"flux.caption_dropout_prob", "1.5"}}); },
               {"flux.caption_dropout_prob", "1.5"});
  expect_error([&] { load_experiment(experiment, {{"flux.caption_dropout_prob", "-0.1"}}); },
               {"flux.caption_dropout_prob"});
  expect_error([&] { load_experiment(experiment, {{"flux.caption_dropout_prob", "0.1"}}); },
               {"flux.caption_dropout_prob = 0.1", "flux.data_path"});
  const ExperimentConfig ok =
      load_experiment(experiment, {{"flux.caption_dropout_prob", "0.1"}, {"flux.data_path", "/somewhere"}});
  EXPECT_EQ(ok.flux.caption_dropout_prob, 0.1);
}

}  // namespace
}  // namespace forge
