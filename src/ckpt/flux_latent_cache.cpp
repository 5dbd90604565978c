// The FLUX latent cache's reader and writer (NOTE [FLUX latent cache] in
// ckpt/flux_latent_cache.h). The reader checks cache.json key by key, then maps every shard
// and checks its three tensors against the manifest, so a run finds a bad cache when it
// opens it, not steps later; read() copies rows out of the mapped shards. The writer
// buffers one shard in fp32, writes it with the safetensors writer (bf16 by round to
// nearest even), and builds the folder under a temporary name that finish() renames into
// place.
#include "ckpt/flux_latent_cache.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "ckpt/safetensors.h"
#include "core/bf16.h"
#include "core/error.h"
#include "core/json_input.h"
#include "data/image_buckets.h"

namespace forge {

namespace fs = std::filesystem;

namespace {

constexpr const char* kManifestName = "cache.json";
constexpr const char* kCaptionsName = "captions.jsonl";
constexpr int64_t kMaxDimension = int64_t{1} << 24;

std::string join(const std::string& folder, const std::string& name) { return (fs::path(folder) / name).string(); }

// The integer at `key` of `object`, in [low, high]; `where` names the file and the object.
int64_t integer_key(const nlohmann::json& object, const char* key, int64_t low, int64_t high,
                    const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end()) FORGE_FAIL("{}: \"{}\" is missing", where, key);
  if (!it->is_number_integer()) FORGE_FAIL("{}: \"{}\" is {}, expected an integer", where, key, describe_json(*it));
  const bool too_large = it->is_number_unsigned() && it->get<uint64_t>() > static_cast<uint64_t>(high);
  if (too_large || it->get<int64_t>() < low || it->get<int64_t>() > high)
    FORGE_FAIL("{}: \"{}\" is {}, expected an integer in [{}, {}]", where, key, describe_json(*it), low, high);
  return it->get<int64_t>();
}

// The finite number at `key` of `object`.
double number_key(const nlohmann::json& object, const char* key, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end()) FORGE_FAIL("{}: \"{}\" is missing", where, key);
  if (!it->is_number() || !std::isfinite(it->get<double>()))
    FORGE_FAIL("{}: \"{}\" is {}, expected a finite number", where, key, describe_json(*it));
  return it->get<double>();
}

std::string string_key(const nlohmann::json& object, const char* key, const std::string& where) {
  const auto it = object.find(key);
  if (it == object.end()) FORGE_FAIL("{}: \"{}\" is missing", where, key);
  if (!it->is_string()) FORGE_FAIL("{}: \"{}\" is {}, expected a string", where, key, describe_json(*it));
  return it->get<std::string>();
}

void check_known_keys(const nlohmann::json& object, const std::set<std::string>& known, const std::string& where) {
  for (const auto& [key, value] : object.items())
    if (!known.count(key)) {
      std::string names;
      for (const std::string& k : known) names += (names.empty() ? "" : ", ") + k;
      FORGE_FAIL("{}: unknown key \"{}\" (a cache.json has {})", where, key, names);
    }
}

// A shard's file name: a plain name inside the folder, ending in .safetensors.
void check_shard_file_name(const std::string& name, const std::string& where) {
  const bool plain = !name.empty() && name.find('/') == std::string::npos && name.find('\\') == std::string::npos &&
                     name != "." && name != ".." && name.find('\0') == std::string::npos;
  if (!plain || name.size() <= 12 || name.substr(name.size() - 12) != ".safetensors")
    FORGE_FAIL("{}: \"file\" is \"{}\", expected the name of a .safetensors file inside the cache folder", where, name);
}

SafetensorsDType stored_dtype(DType dtype) {
  return dtype == DType::BF16 ? SafetensorsDType::BF16 : SafetensorsDType::F32;
}

// Converts `count` stored values at `src` (F32 or BF16, possibly unaligned) into `dst` of
// dtype `to` (F32 or BF16).
void convert_values(void* dst, DType to, const uint8_t* src, SafetensorsDType from, int64_t count) {
  if (from == SafetensorsDType::F32 && to == DType::F32) {
    std::memcpy(dst, src, static_cast<size_t>(count) * 4);
  } else if (from == SafetensorsDType::BF16 && to == DType::BF16) {
    std::memcpy(dst, src, static_cast<size_t>(count) * 2);
  } else if (from == SafetensorsDType::BF16) {
    float* out = static_cast<float*>(dst);
    for (int64_t i = 0; i < count; ++i) {
      BFloat16 b;
      std::memcpy(&b.bits, src + 2 * i, 2);
      out[i] = to_float(b);
    }
  } else {
    BFloat16* out = static_cast<BFloat16*>(dst);
    for (int64_t i = 0; i < count; ++i) {
      float f;
      std::memcpy(&f, src + 4 * i, 4);
      out[i] = to_bf16(f);
    }
  }
}

// Appends a tensor's values (fp32 or bf16, any device) to `out` as fp32.
void append_as_float(std::vector<float>& out, const Tensor& t) {
  const Tensor host = t.device() == Device::CPU ? t : t.to(Device::CPU);
  const size_t begin = out.size();
  out.resize(begin + static_cast<size_t>(host.numel()));
  if (host.dtype() == DType::F32) {
    std::memcpy(out.data() + begin, host.raw(), host.nbytes());
  } else {
    const BFloat16* in = host.data<BFloat16>();
    for (int64_t i = 0; i < host.numel(); ++i) out[begin + static_cast<size_t>(i)] = to_float(in[i]);
  }
}

// captions.jsonl: one line per sample.
void check_captions_file(const std::string& folder, int64_t samples) {
  const std::string path = join(folder, kCaptionsName);
  std::ifstream in(path, std::ios::binary);
  if (!in || !fs::is_regular_file(path))
    FORGE_FAIL("{}: missing (a FLUX latent cache has one caption line per sample)", path);
  int64_t lines = 0;
  std::string line;
  while (std::getline(in, line)) ++lines;
  if (lines != samples)
    FORGE_FAIL("{}: {} lines, {} says {} samples", path, lines, join(folder, kManifestName), samples);
}

}  // namespace

FluxCacheManifest read_flux_cache_manifest(const std::string& folder) {
  const std::string path = join(folder, kManifestName);
  if (!fs::exists(path))
    FORGE_FAIL(
        "{}: no {} (not a FLUX latent cache; forge prep --images or scripts/flux_cache_from_diffusers.py "
        "writes one)",
        folder, kManifestName);
  const nlohmann::json j = read_json_file(path, "the FLUX latent cache's manifest");
  if (!j.is_object()) FORGE_FAIL("{}: is {}, expected a JSON object", path, describe_json(j));
  check_known_keys(j,
                   {"format", "version", "autoencoder", "latent_channels", "text_tokens", "context_dim", "pooled_dim",
                    "dtype", "samples", "shards", "source", "latents", "scaling_factor", "shift_factor",
                    "empty_prompt"},
                   path);
  const std::string format = string_key(j, "format", path);
  if (format != kFluxCacheFormat)
    FORGE_FAIL("{}: \"format\" is \"{}\", expected \"{}\"", path, format, kFluxCacheFormat);
  const int64_t version = integer_key(j, "version", 0, kMaxDimension, path);
  if (version != 1) FORGE_FAIL("{}: \"version\" is {}, this forge reads version 1", path, version);

  FluxCacheManifest m;
  m.autoencoder = string_key(j, "autoencoder", path);
  if (m.autoencoder != "vae" && m.autoencoder != "pixels")
    FORGE_FAIL("{}: \"autoencoder\" is \"{}\", expected \"vae\" or \"pixels\"", path, m.autoencoder);
  m.latent_channels = integer_key(j, "latent_channels", 1, 4096, path);
  if (m.autoencoder == "pixels" && m.latent_channels != 16)
    FORGE_FAIL("{}: \"latent_channels\" is {}, pixel latents have 16 (NOTE [Pixel latents])", path, m.latent_channels);
  m.text_tokens = integer_key(j, "text_tokens", 1, kMaxDimension, path);
  m.context_dim = integer_key(j, "context_dim", 1, kMaxDimension, path);
  m.pooled_dim = integer_key(j, "pooled_dim", 1, kMaxDimension, path);
  const std::string dtype = string_key(j, "dtype", path);
  if (dtype != "bf16" && dtype != "fp32")
    FORGE_FAIL("{}: \"dtype\" is \"{}\", expected \"bf16\" or \"fp32\"", path, dtype);
  m.dtype = dtype == "bf16" ? DType::BF16 : DType::F32;
  m.samples = integer_key(j, "samples", 1, int64_t{1} << 40, path);
  // The optional keys (NOTE [FLUX latent cache]).
  if (j.contains("latents")) {
    m.latents = string_key(j, "latents", path);
    if (m.latents != "mode" && m.latents != "distribution")
      FORGE_FAIL("{}: \"latents\" is \"{}\", expected \"mode\" or \"distribution\"", path, m.latents);
  }
  if (m.distribution()) {
    if (m.autoencoder != "vae")
      FORGE_FAIL("{}: \"latents\" is \"distribution\" and \"autoencoder\" \"{}\": only a VAE has a posterior", path,
                 m.autoencoder);
    m.scaling_factor = number_key(j, "scaling_factor", path);
    m.shift_factor = number_key(j, "shift_factor", path);
    if (m.scaling_factor == 0) FORGE_FAIL("{}: \"scaling_factor\" is 0", path);
  } else {
    for (const char* key : {"scaling_factor", "shift_factor"})
      if (j.contains(key))
        FORGE_FAIL("{}: \"{}\" belongs to \"latents\": \"distribution\" (a mode cache stores scaled latents)", path,
                   key);
  }
  if (j.contains("empty_prompt")) {
    m.empty_prompt = string_key(j, "empty_prompt", path);
    check_shard_file_name(m.empty_prompt, path + ": \"empty_prompt\"");
  }
  if (j.contains("source") && !j.at("source").is_object())
    FORGE_FAIL("{}: \"source\" is {}, expected an object", path, describe_json(j.at("source")));

  const auto shards = j.find("shards");
  if (shards == j.end()) FORGE_FAIL("{}: \"shards\" is missing", path);
  if (!shards->is_array() || shards->empty())
    FORGE_FAIL("{}: \"shards\" is {}, expected a non-empty list of shards", path, describe_json(*shards));
  const int64_t f = m.downsample_factor();
  std::set<std::string> files;
  int64_t total = 0;
  for (size_t s = 0; s < shards->size(); ++s) {
    const nlohmann::json& o = shards->at(s);
    const std::string where = fmt::format("{}: shards[{}]", path, s);
    if (!o.is_object()) FORGE_FAIL("{} is {}, expected an object", where, describe_json(o));
    check_known_keys(o, {"file", "samples", "width", "height"}, where);
    FluxCacheShard shard;
    shard.file = string_key(o, "file", where);
    check_shard_file_name(shard.file, where);
    if (!files.insert(shard.file).second || shard.file == m.empty_prompt)
      FORGE_FAIL("{}: \"file\" \"{}\" is listed twice", where, shard.file);
    shard.samples = integer_key(o, "samples", 1, int64_t{1} << 40, where);
    shard.width = integer_key(o, "width", 1, 16384, where);
    shard.height = integer_key(o, "height", 1, 16384, where);
    check_image_bucket({static_cast<int>(shard.width), static_cast<int>(shard.height)}, where);
    shard.latent_width = shard.width / f;
    shard.latent_height = shard.height / f;
    total += shard.samples;
    m.shards.push_back(shard);
  }
  if (total != m.samples)
    FORGE_FAIL("{}: \"samples\" is {} but the shards hold {} samples together", path, m.samples, total);
  check_captions_file(folder, m.samples);
  return m;
}

bool is_flux_latent_cache(const std::string& folder) {
  const std::string path = join(folder, kManifestName);
  std::error_code error;
  if (!fs::is_regular_file(path, error)) return false;
  try {
    const nlohmann::json j = read_json_file(path, "the FLUX latent cache's manifest");
    return j.is_object() && j.contains("format") && j.at("format") == kFluxCacheFormat;
  } catch (const Error&) {
    return false;
  }
}

struct FluxLatentCache::Files {
  struct Shard {
    std::unique_ptr<SafetensorsFile> file;
    // latents: a mode cache's latents or a distribution cache's latent_mean.
    const SafetensorsEntry *latents = nullptr, *text = nullptr, *pooled = nullptr, *logvar = nullptr;
  };
  std::vector<Shard> shards;
  Shard empty_prompt;  // file null: none (only text and pooled are set)
};

namespace {

// Opens the safetensors file `path` and checks that it holds exactly `expected` (name, shape)
// in `dtype`; returns the entries in that order.
std::vector<const SafetensorsEntry*> check_tensors(const SafetensorsFile& file, const std::string& path,
                                                   const std::vector<std::pair<std::string, Shape>>& expected,
                                                   SafetensorsDType dtype, const std::string& implies) {
  std::string names;
  for (const auto& [name, shape] : expected) names += (names.empty() ? "" : ", ") + name;
  for (const SafetensorsEntry& entry : file.entries()) {
    bool known = false;
    for (const auto& e : expected) known = known || e.first == entry.name;
    if (!known)
      FORGE_FAIL("{}: tensor \"{}\" is not one of this FLUX latent cache's ({})", path, entry.name, names);
  }
  std::vector<const SafetensorsEntry*> found;
  for (const auto& [name, shape] : expected) {
    const SafetensorsEntry* entry = file.find(name);
    if (!entry) FORGE_FAIL("{}: no tensor \"{}\"", path, name);
    if (entry->dtype != dtype)
      FORGE_FAIL("{}: tensor \"{}\" is {}, cache.json says {}", path, name, safetensors_dtype_name(entry->dtype),
                 safetensors_dtype_name(dtype));
    if (entry->shape != shape)
      FORGE_FAIL("{}: tensor \"{}\" has shape {}, cache.json implies {} ({})", path, name, shape_str(entry->shape),
                 shape_str(shape), implies);
    found.push_back(entry);
  }
  return found;
}

}  // namespace

FluxLatentCache::FluxLatentCache(const std::string& folder)
    : folder_(folder), manifest_(read_flux_cache_manifest(folder)), files_(std::make_unique<Files>()) {
  const SafetensorsDType dtype = stored_dtype(manifest_.dtype);
  const FluxCacheManifest& m = manifest_;
  int64_t first = 0;
  for (const FluxCacheShard& shard : m.shards) {
    first_sample_.push_back(first);
    first += shard.samples;
    const std::string path = join(folder, shard.file);
    if (!fs::exists(path)) FORGE_FAIL("{}: missing, but {} lists it", path, join(folder, kManifestName));
    Files::Shard opened{std::make_unique<SafetensorsFile>(path)};
    const Shape latent{shard.samples, m.latent_channels, shard.latent_height, shard.latent_width};
    std::vector<std::pair<std::string, Shape>> expected;
    if (m.distribution()) {
      expected = {{"latent_mean", latent}, {"latent_logvar", latent}};
    } else {
      expected = {{"latents", latent}};
    }
    expected.push_back({"prompt_embeds", {shard.samples, m.text_tokens, m.context_dim}});
    expected.push_back({"pooled_prompt_embeds", {shard.samples, m.pooled_dim}});
    const std::vector<const SafetensorsEntry*> found = check_tensors(
        *opened.file, path, expected, dtype,
        fmt::format("samples {}, bucket {}x{}, autoencoder {}, latents {}", shard.samples, shard.width, shard.height,
                    m.autoencoder, m.latents));
    const size_t t = m.distribution() ? 2 : 1;
    opened.latents = found[0];
    if (m.distribution()) opened.logvar = found[1];
    opened.text = found[t];
    opened.pooled = found[t + 1];
    files_->shards.push_back(std::move(opened));
  }
  if (m.has_empty_prompt()) {
    const std::string path = join(folder, m.empty_prompt);
    if (!fs::exists(path))
      FORGE_FAIL("{}: missing, but {} names it as \"empty_prompt\"", path, join(folder, kManifestName));
    Files::Shard& empty = files_->empty_prompt;
    empty.file = std::make_unique<SafetensorsFile>(path);
    const std::vector<const SafetensorsEntry*> found =
        check_tensors(*empty.file, path,
                      {{"prompt_embeds", {1, m.text_tokens, m.context_dim}},
                       {"pooled_prompt_embeds", {1, m.pooled_dim}}},
                      dtype, "the empty caption's encodings");
    empty.text = found[0];
    empty.pooled = found[1];
  }
}

FluxLatentCache::~FluxLatentCache() = default;

std::pair<int64_t, int64_t> FluxLatentCache::locate(int64_t i) const {
  FORGE_CHECK(i >= 0 && i < size(), "{}: sample {} out of range [0, {})", folder_, i, size());
  const auto it = std::upper_bound(first_sample_.begin(), first_sample_.end(), i);
  const int64_t shard = static_cast<int64_t>(it - first_sample_.begin()) - 1;
  return {shard, i - first_sample_[static_cast<size_t>(shard)]};
}

void FluxLatentCache::read(const std::vector<int64_t>& indices, const Tensor& latents, const Tensor& text,
                           const Tensor& pooled, const FluxCacheReadOptions& options) const {
  const FluxCacheManifest& m = manifest_;
  const int64_t n = static_cast<int64_t>(indices.size());
  FORGE_CHECK(n > 0, "{}: read of no samples", folder_);
  std::vector<std::pair<int64_t, int64_t>> where;
  for (const int64_t i : indices) where.push_back(locate(i));
  const FluxCacheShard& first = m.shards[static_cast<size_t>(where[0].first)];
  for (size_t k = 1; k < where.size(); ++k) {
    const FluxCacheShard& s = m.shards[static_cast<size_t>(where[k].first)];
    FORGE_CHECK(s.latent_width == first.latent_width && s.latent_height == first.latent_height,
                "{}: samples {} ({}x{}) and {} ({}x{}) of one read are of different buckets", folder_, indices[0],
                first.width, first.height, indices[k], s.width, s.height);
  }
  const Shape latent_shape{n, m.latent_channels, first.latent_height, first.latent_width};
  check_shape(latents, latent_shape, "FLUX cache latents");
  check_shape(text, {n, m.text_tokens, m.context_dim}, "FLUX cache prompt_embeds");
  check_shape(pooled, {n, m.pooled_dim}, "FLUX cache pooled_prompt_embeds");
  const std::vector<uint8_t>& dropped = options.empty_caption;
  FORGE_CHECK(dropped.empty() || static_cast<int64_t>(dropped.size()) == n,
              "{}: {} empty-caption flags for a read of {} samples", folder_, dropped.size(), n);
  const bool any_dropped = std::any_of(dropped.begin(), dropped.end(), [](uint8_t d) { return d != 0; });
  FORGE_CHECK(!any_dropped || m.has_empty_prompt(), "{}: the cache holds no empty caption's encodings", folder_);
  const Tensor* noise = options.latent_noise;
  if (noise) {
    FORGE_CHECK(m.distribution(), "{}: latent noise for a cache of fixed latents (\"latents\": \"{}\")", folder_,
                m.latents);
    FORGE_CHECK(noise->device() == Device::CPU && noise->dtype() == DType::F32,
                "FLUX cache latent noise: fp32 on the host");
    check_shape(*noise, latent_shape, "FLUX cache latent noise");
  }
  const SafetensorsDType from = stored_dtype(m.dtype);
  const size_t from_size = safetensors_dtype_size(from);
  const Tensor* outs[] = {&latents, &text, &pooled};
  std::vector<float> mean, logvar;
  for (size_t t = 0; t < 3; ++t) {
    const Tensor& out = *outs[t];
    FORGE_CHECK(out.dtype() == DType::F32 || out.dtype() == DType::BF16, "FLUX cache read into {}: fp32 or bf16",
                dtype_name(out.dtype()));
    const int64_t row = out.numel() / n;
    const Tensor host = out.device() == Device::CPU ? out : Tensor::empty(out.shape(), out.dtype());
    uint8_t* dst = static_cast<uint8_t*>(host.raw());
    for (int64_t k = 0; k < n; ++k) {
      const auto [shard_index, shard_row] = where[static_cast<size_t>(k)];
      uint8_t* to = dst + static_cast<size_t>(k * row) * dtype_size(out.dtype());
      const bool empty_caption = t > 0 && !dropped.empty() && dropped[static_cast<size_t>(k)] != 0;
      const Files::Shard& shard =
          empty_caption ? files_->empty_prompt : files_->shards[static_cast<size_t>(shard_index)];
      const int64_t source_row = empty_caption ? 0 : shard_row;
      const SafetensorsEntry* entry = t == 0 ? shard.latents : t == 1 ? shard.text : shard.pooled;
      const uint8_t* src = shard.file->bytes(*entry) + static_cast<size_t>(source_row * row) * from_size;
      if (t > 0 || !m.distribution()) {
        convert_values(to, out.dtype(), src, from, row);
        continue;
      }
      // NOTE [FLUX posterior latents]: in fp32, then converted.
      mean.resize(static_cast<size_t>(row));
      logvar.resize(static_cast<size_t>(row));
      convert_values(mean.data(), DType::F32, src, from, row);
      const uint8_t* logvar_src = shard.file->bytes(*shard.logvar) + static_cast<size_t>(shard_row * row) * from_size;
      convert_values(logvar.data(), DType::F32, logvar_src, from, row);
      const float scale = static_cast<float>(m.scaling_factor), shift = static_cast<float>(m.shift_factor);
      const float* eps = noise ? noise->data<float>() + k * row : nullptr;
      for (int64_t e = 0; e < row; ++e) {
        float z = mean[static_cast<size_t>(e)];
        if (eps) z += std::exp(0.5f * std::clamp(logvar[static_cast<size_t>(e)], -30.0f, 20.0f)) * eps[e];
        mean[static_cast<size_t>(e)] = (z - shift) * scale;
      }
      convert_values(to, out.dtype(), reinterpret_cast<const uint8_t*>(mean.data()), SafetensorsDType::F32, row);
    }
    if (out.device() != Device::CPU) out.copy_from(host);
  }
}

// ---- the writer

namespace {

// check_flux_cache_output, then creates the parent folder. Returns `folder`.
std::string writable_cache_folder(const std::string& folder, bool overwrite) {
  check_flux_cache_output(folder, overwrite);
  const fs::path parent = fs::absolute(fs::path(folder)).parent_path();
  fs::create_directories(parent);
  return folder;
}

}  // namespace

void check_flux_cache_output(const std::string& folder, bool overwrite) {
  if (folder.empty()) FORGE_FAIL("the FLUX latent cache's output folder is empty");
  std::error_code error;
  const fs::file_status status = fs::symlink_status(folder, error);
  if (fs::exists(status)) {
    if (!fs::is_directory(status))
      FORGE_FAIL("{} exists and is not a folder: refusing to replace it with a FLUX latent cache", folder);
    bool empty = true, only_cache_files = true;
    for (const fs::directory_entry& e : fs::directory_iterator(folder)) {
      empty = false;
      const std::string name = e.path().filename().string();
      const bool cache_file =
          name == kManifestName || name == kCaptionsName || name == kFluxCacheEmptyPrompt ||
          (name.rfind("shard-", 0) == 0 && name.size() > 12 && name.substr(name.size() - 12) == ".safetensors");
      if (!cache_file || !e.is_regular_file()) only_cache_files = false;
    }
    if (!empty) {
      if (!is_flux_latent_cache(folder) || !only_cache_files)
        FORGE_FAIL(
            "{} exists and is not a FLUX latent cache (cache.json, captions.jsonl, shard files and {} only): "
            "refusing to replace it; choose another --output",
            folder, kFluxCacheEmptyPrompt);
      if (!overwrite)
        FORGE_FAIL("{} already holds a FLUX latent cache: give --overwrite to replace it, or choose another --output",
                   folder);
    }
  }
}

FluxLatentCacheWriter::FluxLatentCacheWriter(std::string folder, FluxCacheWriterOptions options)
    : options_(std::move(options)),
      directory_(writable_cache_folder(folder, options_.overwrite), DurableOptions{.sync = false}) {
  const FluxCacheWriterOptions& o = options_;
  FORGE_CHECK(o.autoencoder == "vae" || o.autoencoder == "pixels", "FLUX cache writer: autoencoder \"{}\"",
              o.autoencoder);
  FORGE_CHECK(o.latent_channels > 0 && o.text_tokens > 0 && o.context_dim > 0 && o.pooled_dim > 0,
              "FLUX cache writer: dimensions {} {} {} {}", o.latent_channels, o.text_tokens, o.context_dim,
              o.pooled_dim);
  FORGE_CHECK(o.dtype == DType::F32 || o.dtype == DType::BF16, "FLUX cache writer: dtype {}", dtype_name(o.dtype));
  FORGE_CHECK(o.latents == "mode" || (o.latents == "distribution" && o.autoencoder == "vae"),
              "FLUX cache writer: latents \"{}\" of autoencoder \"{}\"", o.latents, o.autoencoder);
  FORGE_CHECK(o.max_shard_samples > 0 && o.max_shard_bytes > 0, "FLUX cache writer: shard limits {} samples, {} bytes",
              o.max_shard_samples, o.max_shard_bytes);
  manifest_.autoencoder = o.autoencoder;
  manifest_.latent_channels = o.latent_channels;
  manifest_.text_tokens = o.text_tokens;
  manifest_.context_dim = o.context_dim;
  manifest_.pooled_dim = o.pooled_dim;
  manifest_.dtype = o.dtype;
  manifest_.latents = o.latents;
  if (manifest_.distribution()) {
    manifest_.scaling_factor = o.scaling_factor;
    manifest_.shift_factor = o.shift_factor;
  }
}

FluxLatentCacheWriter::~FluxLatentCacheWriter() = default;

void FluxLatentCacheWriter::append(int64_t width, int64_t height, const Tensor& latents, const Tensor& text,
                                   const Tensor& pooled, const std::vector<std::string>& images,
                                   const std::vector<std::string>& captions) {
  FORGE_CHECK(!finished_, "FLUX cache writer: append after finish");
  check_image_bucket({static_cast<int>(width), static_cast<int>(height)}, "FLUX cache bucket");
  const int64_t n = latents.ndim() > 0 ? latents.dim(0) : 0, f = manifest_.downsample_factor();
  FORGE_CHECK(n > 0 && static_cast<int64_t>(images.size()) == n && static_cast<int64_t>(captions.size()) == n,
              "FLUX cache writer: {} latents, {} images, {} captions", n, images.size(), captions.size());
  const bool moments = manifest_.distribution();  // the mean and the logvar, channels [0, C) and [C, 2C)
  check_shape(latents, {n, manifest_.latent_channels * (moments ? 2 : 1), height / f, width / f},
              moments ? "FLUX cache VAE moments" : "FLUX cache latents");
  check_shape(text, {n, manifest_.text_tokens, manifest_.context_dim}, "FLUX cache prompt_embeds");
  check_shape(pooled, {n, manifest_.pooled_dim}, "FLUX cache pooled_prompt_embeds");
  if (open_samples_ > 0 && (width != open_width_ || height != open_height_)) write_open_shard();
  open_width_ = width;
  open_height_ = height;
  const int64_t per_sample = latents.numel() / n + text.numel() / n + pooled.numel() / n;
  const int64_t sample_bytes = per_sample * static_cast<int64_t>(dtype_size(manifest_.dtype));
  const int64_t shard_samples =
      std::clamp(options_.max_shard_bytes / sample_bytes, int64_t{1}, options_.max_shard_samples);
  std::vector<float> l, t, p;
  append_as_float(l, latents);
  append_as_float(t, text);
  append_as_float(p, pooled);
  for (int64_t i = 0; i < n; ++i) {
    const auto row = [&](std::vector<float>& to, const std::vector<float>& from, int64_t size) {
      to.insert(to.end(), from.begin() + i * size, from.begin() + (i + 1) * size);
    };
    if (moments) {
      const int64_t size = latents.numel() / n / 2;
      latents_.insert(latents_.end(), l.begin() + 2 * i * size, l.begin() + (2 * i + 1) * size);
      logvar_.insert(logvar_.end(), l.begin() + (2 * i + 1) * size, l.begin() + (2 * i + 2) * size);
    } else {
      row(latents_, l, latents.numel() / n);
    }
    row(text_, t, text.numel() / n);
    row(pooled_, p, pooled.numel() / n);
    images_.push_back(images[static_cast<size_t>(i)]);
    open_captions_.push_back(captions[static_cast<size_t>(i)]);
    if (++open_samples_ == shard_samples) write_open_shard();
  }
}

void FluxLatentCacheWriter::write_open_shard() {
  if (open_samples_ == 0) return;
  const int64_t n = open_samples_, f = manifest_.downsample_factor();
  FluxCacheShard shard;
  shard.file = fmt::format("shard-{:05d}.safetensors", manifest_.shards.size());
  shard.samples = n;
  shard.width = open_width_;
  shard.height = open_height_;
  shard.latent_width = open_width_ / f;
  shard.latent_height = open_height_ / f;
  const std::string path = join(directory_.temporary_path(), shard.file);
  const Shape latent{n, manifest_.latent_channels, shard.latent_height, shard.latent_width};
  std::vector<SafetensorsTensorRef> tensors;
  if (manifest_.distribution()) {
    tensors.push_back({"latent_mean", latent, latents_.data()});
    tensors.push_back({"latent_logvar", latent, logvar_.data()});
  } else {
    tensors.push_back({"latents", latent, latents_.data()});
  }
  tensors.push_back({"prompt_embeds", {n, manifest_.text_tokens, manifest_.context_dim}, text_.data()});
  tensors.push_back({"pooled_prompt_embeds", {n, manifest_.pooled_dim}, pooled_.data()});
  write_safetensors(path, tensors, stored_dtype(manifest_.dtype), {{"format", kFluxCacheFormat}});
  bytes_written_ += static_cast<int64_t>(fs::file_size(path));
  const size_t index = manifest_.shards.size();
  for (int64_t r = 0; r < n; ++r)
    captions_ += nlohmann::json{{"shard", index},
                                {"row", r},
                                {"image", images_[static_cast<size_t>(r)]},
                                {"caption", open_captions_[static_cast<size_t>(r)]}}
                     .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
                 "\n";
  manifest_.shards.push_back(shard);
  manifest_.samples += n;
  open_samples_ = 0;
  latents_.clear();
  logvar_.clear();
  text_.clear();
  pooled_.clear();
  images_.clear();
  open_captions_.clear();
}

void FluxLatentCacheWriter::set_empty_prompt(const Tensor& text, const Tensor& pooled) {
  FORGE_CHECK(!finished_, "FLUX cache writer: set_empty_prompt after finish");
  check_shape(text, {1, manifest_.text_tokens, manifest_.context_dim}, "FLUX cache empty prompt_embeds");
  check_shape(pooled, {1, manifest_.pooled_dim}, "FLUX cache empty pooled_prompt_embeds");
  empty_text_.clear();
  empty_pooled_.clear();
  append_as_float(empty_text_, text);
  append_as_float(empty_pooled_, pooled);
}

FluxCacheManifest FluxLatentCacheWriter::finish() {
  FORGE_CHECK(!finished_, "FLUX cache writer: finish called twice");
  write_open_shard();
  if (manifest_.samples == 0) FORGE_FAIL("{}: no samples to write", directory_.path());
  const DurableOptions options{.sync = false};
  write_file_atomic(join(directory_.temporary_path(), kCaptionsName), captions_, options);
  if (!empty_text_.empty()) {
    write_safetensors(join(directory_.temporary_path(), kFluxCacheEmptyPrompt),
                      {{"prompt_embeds", {1, manifest_.text_tokens, manifest_.context_dim}, empty_text_.data()},
                       {"pooled_prompt_embeds", {1, manifest_.pooled_dim}, empty_pooled_.data()}},
                      stored_dtype(manifest_.dtype), {{"format", kFluxCacheFormat}});
    manifest_.empty_prompt = kFluxCacheEmptyPrompt;
  }
  nlohmann::json shards = nlohmann::json::array();
  for (const FluxCacheShard& s : manifest_.shards)
    shards.push_back({{"file", s.file}, {"samples", s.samples}, {"width", s.width}, {"height", s.height}});
  nlohmann::ordered_json manifest;
  manifest["format"] = kFluxCacheFormat;
  manifest["version"] = 1;
  manifest["autoencoder"] = manifest_.autoencoder;
  manifest["latent_channels"] = manifest_.latent_channels;
  manifest["text_tokens"] = manifest_.text_tokens;
  manifest["context_dim"] = manifest_.context_dim;
  manifest["pooled_dim"] = manifest_.pooled_dim;
  manifest["dtype"] = manifest_.dtype == DType::BF16 ? "bf16" : "fp32";
  if (manifest_.distribution()) {
    manifest["latents"] = manifest_.latents;
    manifest["scaling_factor"] = manifest_.scaling_factor;
    manifest["shift_factor"] = manifest_.shift_factor;
  }
  if (manifest_.has_empty_prompt()) manifest["empty_prompt"] = manifest_.empty_prompt;
  manifest["samples"] = manifest_.samples;
  manifest["shards"] = shards;
  manifest["source"] = options_.source;
  write_file_atomic(join(directory_.temporary_path(), kManifestName),
                    manifest.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n", options);
  FluxLatentCache check(directory_.temporary_path());
  directory_.commit();
  finished_ = true;
  return manifest_;
}

}  // namespace forge
