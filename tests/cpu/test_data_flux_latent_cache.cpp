// The FLUX latent cache (NOTE [FLUX latent cache]): a written cache reads back (fp32 exact,
// bf16 rounded to nearest even, into fp32 or bf16), shards split by count and bytes and by
// bucket, every bad manifest key and every bad shard tensor refused naming the file and the
// key or tensor, and the writer's output folder: refused when it holds something else or a
// cache without overwrite, untouched when writing fails.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "ckpt/safetensors.h"
#include "core/bf16.h"
#include "ckpt/flux_latent_cache.h"
#include "expect_error.h"
#include "test_data_temp_dir.h"

namespace forge {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Values that identify their sample and position: 1000 * sample + 0.25 * position (+ kind).
Tensor pattern(Shape shape, int64_t first_sample, float kind) {
  Tensor t = Tensor::empty(shape);
  const int64_t row = t.numel() / shape[0];
  for (int64_t i = 0; i < t.numel(); ++i)
    t.data<float>()[i] =
        kind + 1000.0f * static_cast<float>(first_sample + i / row) + 0.25f * static_cast<float>(i % row);
  return t;
}

FluxCacheWriterOptions small_options(DType dtype = DType::F32) {
  FluxCacheWriterOptions o;
  o.latent_channels = 16;
  o.text_tokens = 3;
  o.context_dim = 4;
  o.pooled_dim = 5;
  o.dtype = dtype;
  o.max_shard_samples = 2;
  return o;
}

// Appends n samples numbered from `first` of bucket w x h (vae: latents at 1/8).
void append(FluxLatentCacheWriter& writer, int64_t first, int64_t n, int64_t w, int64_t h, int64_t f = 8) {
  std::vector<std::string> images, captions;
  for (int64_t i = 0; i < n; ++i) {
    images.push_back("img" + std::to_string(first + i) + ".png");
    captions.push_back("caption " + std::to_string(first + i) + " \"quoted\" é");
  }
  writer.append(w, h, pattern({n, 16, h / f, w / f}, first, 0.0f), pattern({n, 3, 4}, first, 0.5f),
                pattern({n, 5}, first, 0.125f), images, captions);
}

// A cache of 5 samples: 3 of 32x16 (shards of 2 and 1), then 2 of 16x16.
std::string write_small(const TempDir& dir, DType dtype = DType::F32) {
  const std::string folder = dir.file("cache");
  FluxLatentCacheWriter writer(folder, small_options(dtype));
  append(writer, 0, 3, 32, 16);
  append(writer, 3, 2, 16, 16);
  writer.finish();
  return folder;
}

TEST(FluxLatentCache, RoundTripFp32) {
  TempDir dir;
  const std::string folder = write_small(dir);
  FluxLatentCache cache(folder);
  const FluxCacheManifest& m = cache.manifest();
  EXPECT_EQ(m.autoencoder, "vae");
  EXPECT_EQ(m.samples, 5);
  ASSERT_EQ(m.shards.size(), 3u);
  EXPECT_EQ(m.shards[0].samples, 2);
  EXPECT_EQ(m.shards[1].samples, 1);
  EXPECT_EQ(m.shards[2].samples, 2);
  EXPECT_EQ(m.shards[0].width, 32);
  EXPECT_EQ(m.shards[0].latent_width, 4);
  EXPECT_EQ(m.shards[0].latent_height, 2);
  EXPECT_EQ(m.shards[2].file, "shard-00002.safetensors");
  EXPECT_EQ(cache.locate(2), std::make_pair(int64_t{1}, int64_t{0}));
  EXPECT_EQ(cache.locate(4), std::make_pair(int64_t{2}, int64_t{1}));

  Tensor latents = Tensor::empty({2, 16, 2, 4}), text = Tensor::empty({2, 3, 4}), pooled = Tensor::empty({2, 5});
  cache.read({2, 0}, latents, text, pooled);
  const Tensor expect2 = pattern({1, 16, 2, 4}, 2, 0.0f), expect0 = pattern({1, 16, 2, 4}, 0, 0.0f);
  for (int64_t i = 0; i < 128; ++i) {
    EXPECT_EQ(latents.data<float>()[i], expect2.data<float>()[i]);
    EXPECT_EQ(latents.data<float>()[128 + i], expect0.data<float>()[i]);
  }
  const Tensor t0 = pattern({1, 3, 4}, 0, 0.5f), p2 = pattern({1, 5}, 2, 0.125f);
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(text.data<float>()[12 + i], t0.data<float>()[i]);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(pooled.data<float>()[i], p2.data<float>()[i]);

  std::ifstream captions(folder + "/captions.jsonl");
  std::string line;
  std::vector<json> lines;
  while (std::getline(captions, line)) lines.push_back(json::parse(line));
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[3]["shard"], 2);
  EXPECT_EQ(lines[3]["row"], 0);
  EXPECT_EQ(lines[3]["image"], "img3.png");
  EXPECT_EQ(lines[3]["caption"], "caption 3 \"quoted\" é");
}

TEST(FluxLatentCache, Bf16StoredAndReadIntoEitherDtype) {
  TempDir dir;
  const std::string folder = write_small(dir, DType::BF16);
  FluxLatentCache cache(folder);
  EXPECT_EQ(cache.manifest().dtype, DType::BF16);
  Tensor latents = Tensor::empty({2, 16, 2, 2}), text = Tensor::empty({2, 3, 4}), pooled = Tensor::empty({2, 5});
  Tensor latents16 = Tensor::empty({2, 16, 2, 2}, DType::BF16), text16 = Tensor::empty({2, 3, 4}, DType::BF16),
         pooled16 = Tensor::empty({2, 5}, DType::BF16);
  cache.read({3, 4}, latents, text, pooled);
  cache.read({3, 4}, latents16, text16, pooled16);
  const Tensor expect = pattern({2, 16, 2, 2}, 3, 0.0f);
  for (int64_t i = 0; i < expect.numel(); ++i) {
    const float rounded = to_float(to_bf16(expect.data<float>()[i]));
    EXPECT_EQ(latents.data<float>()[i], rounded);
    EXPECT_EQ(latents16.data<BFloat16>()[i].bits, to_bf16(expect.data<float>()[i]).bits);
  }
  const Tensor pe = pattern({2, 5}, 3, 0.125f);
  for (int64_t i = 0; i < pe.numel(); ++i) EXPECT_EQ(pooled.data<float>()[i], to_float(to_bf16(pe.data<float>()[i])));
}

TEST(FluxLatentCache, ReadChecksIndicesBucketsAndShapes) {
  TempDir dir;
  FluxLatentCache cache(write_small(dir));
  Tensor latents = Tensor::empty({2, 16, 2, 4}), text = Tensor::empty({2, 3, 4}), pooled = Tensor::empty({2, 5});
  expect_error([&] { cache.read({0, 5}, latents, text, pooled); }, {"sample 5 out of range"});
  expect_error([&] { cache.read({0, 3}, latents, text, pooled); }, {"different buckets"});
  Tensor wrong = Tensor::empty({2, 16, 4, 2});
  expect_error([&] { cache.read({0, 1}, wrong, text, pooled); }, {"latents"});
  Tensor ints = Tensor::empty({2, 5}, DType::I32);
  expect_error([&] { cache.read({0, 1}, latents, text, ints); }, {"fp32 or bf16"});
}

TEST(FluxLatentCache, ShardsCloseAtTheByteLimit) {
  TempDir dir;
  FluxCacheWriterOptions o = small_options();
  o.max_shard_samples = 100;
  o.max_shard_bytes = (16 * 2 * 2 + 12 + 5) * 4 * 3 + 10;  // three 16x16 samples
  FluxLatentCacheWriter writer(dir.file("cache"), o);
  append(writer, 0, 7, 16, 16);
  writer.finish();
  FluxLatentCache cache(dir.file("cache"));
  ASSERT_EQ(cache.manifest().shards.size(), 3u);
  EXPECT_EQ(cache.manifest().shards[0].samples, 3);
  EXPECT_EQ(cache.manifest().shards[2].samples, 1);
}

TEST(FluxLatentCache, PixelLatentsHaveHalfTheSide) {
  TempDir dir;
  FluxCacheWriterOptions o = small_options();
  o.autoencoder = "pixels";
  FluxLatentCacheWriter writer(dir.file("cache"), o);
  append(writer, 0, 1, 32, 16, 2);
  writer.finish();
  FluxLatentCache cache(dir.file("cache"));
  EXPECT_EQ(cache.manifest().downsample_factor(), 2);
  EXPECT_EQ(cache.manifest().shards[0].latent_width, 16);
  EXPECT_EQ(cache.manifest().shards[0].latent_height, 8);
}

// Rewrites cache.json with `edit` applied and expects opening to fail naming every fragment.
void expect_manifest_refused(const std::string& folder, const std::function<void(json&)>& edit,
                             const std::vector<std::string>& fragments) {
  const std::string path = folder + "/cache.json";
  std::ifstream in(path);
  const json original = json::parse(in);
  json edited = original;
  edit(edited);
  std::ofstream(path) << edited.dump();
  std::vector<std::string> all = fragments;
  all.push_back("cache.json");
  expect_error([&] { FluxLatentCache cache(folder); }, all);
  std::ofstream(path) << original.dump();
}

TEST(FluxLatentCache, RefusesBadManifests) {
  TempDir dir;
  const std::string folder = write_small(dir);
  using E = std::function<void(json&)>;
  const std::vector<std::pair<E, std::vector<std::string>>> cases = {
      {[](json& j) { j["format"] = "other"; }, {"\"format\""}},
      {[](json& j) { j.erase("format"); }, {"\"format\" is missing"}},
      {[](json& j) { j["version"] = 2; }, {"\"version\" is 2"}},
      {[](json& j) { j["version"] = "1"; }, {"\"version\"", "expected an integer"}},
      {[](json& j) { j["autoencoder"] = "vqgan"; }, {"\"autoencoder\""}},
      {[](json& j) { j["latent_channels"] = 0; }, {"\"latent_channels\""}},
      {[](json& j) { j["latent_channels"] = 4.5; }, {"\"latent_channels\"", "integer"}},
      {[](json& j) { j["text_tokens"] = -3; }, {"\"text_tokens\""}},
      {[](json& j) { j["context_dim"] = true; }, {"\"context_dim\""}},
      {[](json& j) { j["pooled_dim"] = 18446744073709551615ull; }, {"\"pooled_dim\""}},
      {[](json& j) { j["dtype"] = "fp16"; }, {"\"dtype\""}},
      {[](json& j) { j["samples"] = 6; }, {"\"samples\" is 6", "hold 5"}},
      {[](json& j) { j["samples"] = 0; }, {"\"samples\""}},
      {[](json& j) { j["shards"] = json::array(); }, {"\"shards\""}},
      {[](json& j) { j["shards"][0] = 3; }, {"shards[0]"}},
      {[](json& j) { j["shards"][1]["file"] = "../x.safetensors"; }, {"shards[1]", "\"file\""}},
      {[](json& j) { j["shards"][1]["file"] = "shard.bin"; }, {"shards[1]", "\"file\""}},
      {[](json& j) { j["shards"][1]["file"] = j["shards"][0]["file"]; }, {"shards[1]", "listed twice"}},
      {[](json& j) { j["shards"][2]["width"] = 24; }, {"shards[2]", "16"}},
      {[](json& j) { j["shards"][2].erase("height"); }, {"shards[2]", "\"height\" is missing"}},
      {[](json& j) { j["shards"][0]["samples"] = 0; }, {"shards[0]", "\"samples\""}},
      {[](json& j) { j["shards"][0]["extra"] = 1; }, {"shards[0]", "unknown key \"extra\""}},
      {[](json& j) { j["latents"] = 1; }, {"\"latents\"", "expected a string"}},
      {[](json& j) { j["latents"] = "sample"; }, {"\"latents\" is \"sample\""}},
      {[](json& j) { j["latents"] = "distribution"; }, {"\"scaling_factor\" is missing"}},
      {[](json& j) { j["scaling_factor"] = 0.5; }, {"\"scaling_factor\"", "\"distribution\""}},
      {[](json& j) { j["empty_prompt"] = "../e.safetensors"; }, {"\"empty_prompt\""}},
      {[](json& j) { j["empty_prompt"] = j["shards"][0]["file"]; }, {"listed twice"}},
      {[](json& j) { j["latenz"] = 1; }, {"unknown key \"latenz\""}},
      {[](json& j) { j["source"] = "x"; }, {"\"source\""}},
      {[](json& j) { j = json::array(); }, {"expected a JSON object"}},
      {[](json& j) {
         j["autoencoder"] = "pixels";
         j["latent_channels"] = 4;
       },
       {"pixel latents have 16"}},
  };
  for (const auto& [edit, fragments] : cases) expect_manifest_refused(folder, edit, fragments);
  // Not JSON at all; no manifest; a captions file of the wrong length.
  std::ofstream(folder + "/cache.json.bak") << "";
  fs::rename(folder + "/cache.json", folder + "/cache.json.bak");
  expect_error([&] { FluxLatentCache cache(folder); }, {"no cache.json"});
  std::ofstream(folder + "/cache.json") << "{\"format\": ";
  expect_error([&] { FluxLatentCache cache(folder); }, {"cache.json", "JSON"});
  fs::rename(folder + "/cache.json.bak", folder + "/cache.json");
  std::ofstream(folder + "/captions.jsonl", std::ios::app) << "{}\n";
  expect_error([&] { FluxLatentCache cache(folder); }, {"captions.jsonl", "6 lines"});
}

// Replaces shard 1 (one 32x16 sample) with the given tensors and expects opening to fail.
void expect_shard_refused(const std::string& folder, const std::vector<SafetensorsTensorRef>& tensors,
                          SafetensorsDType dtype, const std::vector<std::string>& fragments) {
  const std::string path = folder + "/shard-00001.safetensors";
  fs::copy_file(path, path + ".bak", fs::copy_options::overwrite_existing);
  write_safetensors(path, tensors, dtype, {});
  std::vector<std::string> all = fragments;
  all.push_back("shard-00001.safetensors");
  expect_error([&] { FluxLatentCache cache(folder); }, all);
  fs::rename(path + ".bak", path);
}

TEST(FluxLatentCache, RefusesBadShards) {
  TempDir dir;
  const std::string folder = write_small(dir);
  std::vector<float> values(16 * 2 * 4 * 4, 0.0f);
  const float* v = values.data();
  const SafetensorsTensorRef latents{"latents", {1, 16, 2, 4}, v}, text{"prompt_embeds", {1, 3, 4}, v},
      pooled{"pooled_prompt_embeds", {1, 5}, v};
  const auto F32 = SafetensorsDType::F32;
  expect_shard_refused(folder, {latents, text}, F32, {"no tensor \"pooled_prompt_embeds\""});
  expect_shard_refused(folder, {latents, text, pooled, {"extra", {1}, v}}, F32, {"tensor \"extra\""});
  expect_shard_refused(folder, {latents, text, pooled}, SafetensorsDType::BF16, {"\"latents\"", "BF16", "F32"});
  expect_shard_refused(folder, {{"latents", {1, 16, 4, 2}, v}, text, pooled}, F32, {"\"latents\"", "[1, 16, 2, 4]"});
  expect_shard_refused(folder, {latents, {"prompt_embeds", {2, 3, 4}, v}, pooled}, F32, {"\"prompt_embeds\""});
  expect_shard_refused(folder, {latents, text, {"pooled_prompt_embeds", {1, 6}, v}}, F32, {"\"pooled_prompt_embeds\""});
  // Missing, truncated.
  fs::rename(folder + "/shard-00001.safetensors", folder + "/moved");
  expect_error([&] { FluxLatentCache cache(folder); }, {"shard-00001.safetensors", "missing"});
  fs::rename(folder + "/moved", folder + "/shard-00001.safetensors");
  fs::resize_file(folder + "/shard-00001.safetensors", fs::file_size(folder + "/shard-00001.safetensors") - 4);
  expect_error([&] { FluxLatentCache cache(folder); }, {"shard-00001.safetensors"});
}

TEST(FluxLatentCache, WriterRefusesFoldersItMustNotReplace) {
  TempDir dir;
  const std::string folder = write_small(dir);
  expect_error([&] { FluxLatentCacheWriter w(folder, small_options()); }, {folder, "--overwrite"});
  // A file, a folder of other things, a cache with a stranger file in it: never replaced.
  std::ofstream(dir.file("file")) << "x";
  expect_error([&] { FluxLatentCacheWriter w(dir.file("file"), small_options()); }, {"not a folder"});
  fs::create_directories(dir.file("photos"));
  std::ofstream(dir.file("photos/a.jpg")) << "x";
  FluxCacheWriterOptions overwrite = small_options();
  overwrite.overwrite = true;
  expect_error([&] { FluxLatentCacheWriter w(dir.file("photos"), overwrite); }, {"not a FLUX latent cache"});
  std::ofstream(folder + "/notes.txt") << "mine";
  expect_error([&] { FluxLatentCacheWriter w(folder, overwrite); }, {"not a FLUX latent cache"});
  fs::remove(folder + "/notes.txt");
  // With overwrite, a cache is replaced; an empty folder is filled.
  {
    FluxLatentCacheWriter w(folder, overwrite);
    append(w, 0, 1, 16, 16);
    w.finish();
  }
  EXPECT_EQ(FluxLatentCache(folder).size(), 1);
  fs::create_directories(dir.file("empty"));
  FluxLatentCacheWriter w(dir.file("empty"), small_options());
  append(w, 0, 1, 16, 16);
  w.finish();
  EXPECT_EQ(FluxLatentCache(dir.file("empty")).size(), 1);
}

TEST(FluxLatentCache, FailedWriteLeavesTheOldCacheAndNoTemporary) {
  TempDir dir;
  const std::string folder = write_small(dir);
  FluxCacheWriterOptions overwrite = small_options();
  overwrite.overwrite = true;
  {
    FluxLatentCacheWriter w(folder, overwrite);
    append(w, 0, 3, 16, 16);  // a shard written into the temporary folder
    expect_error(
        [&] {
          w.append(16, 16, Tensor::empty({1, 16, 2, 2}), Tensor::empty({1, 3, 9}), Tensor::empty({1, 5}), {"a"}, {"b"});
        },
        {"prompt_embeds"});
  }  // destroyed unfinished
  EXPECT_EQ(FluxLatentCache(folder).size(), 5);
  int entries = 0;
  for (const auto& e : fs::directory_iterator(fs::path(folder).parent_path())) entries += e.path() != folder;
  EXPECT_EQ(entries, 0) << "a temporary folder was left behind";
  {
    FluxLatentCacheWriter w(dir.file("nothing"), small_options());
    expect_error([&] { w.finish(); }, {"no samples"});
  }
  EXPECT_FALSE(fs::exists(dir.file("nothing")));
  // A new cache's parent folders are created.
  FluxLatentCacheWriter nested(dir.file("a/b/cache"), small_options());
  append(nested, 0, 1, 16, 16);
  nested.finish();
  EXPECT_EQ(FluxLatentCache(dir.file("a/b/cache")).size(), 1);
}

}  // namespace
}  // namespace forge
