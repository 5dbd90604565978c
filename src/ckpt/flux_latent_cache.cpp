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
                    "dtype", "samples", "shards", "source"},
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
    if (!files.insert(shard.file).second) FORGE_FAIL("{}: \"file\" \"{}\" is listed twice", where, shard.file);
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
    const SafetensorsEntry *latents = nullptr, *text = nullptr, *pooled = nullptr;
  };
  std::vector<Shard> shards;
};

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
    const std::pair<const char*, Shape> expected[] = {
        {"latents", {shard.samples, m.latent_channels, shard.latent_height, shard.latent_width}},
        {"prompt_embeds", {shard.samples, m.text_tokens, m.context_dim}},
        {"pooled_prompt_embeds", {shard.samples, m.pooled_dim}}};
    const SafetensorsEntry** slots[] = {&opened.latents, &opened.text, &opened.pooled};
    for (const SafetensorsEntry& entry : opened.file->entries())
      if (entry.name != "latents" && entry.name != "prompt_embeds" && entry.name != "pooled_prompt_embeds")
        FORGE_FAIL(
            "{}: tensor \"{}\" is not one of a FLUX latent cache's (latents, prompt_embeds, "
            "pooled_prompt_embeds)",
            path, entry.name);
    for (size_t t = 0; t < 3; ++t) {
      const auto& [name, shape] = expected[t];
      const SafetensorsEntry* entry = opened.file->find(name);
      if (!entry) FORGE_FAIL("{}: no tensor \"{}\"", path, name);
      if (entry->dtype != dtype)
        FORGE_FAIL("{}: tensor \"{}\" is {}, cache.json says {}", path, name, safetensors_dtype_name(entry->dtype),
                   safetensors_dtype_name(dtype));
      if (entry->shape != shape)
        FORGE_FAIL(
            "{}: tensor \"{}\" has shape {}, cache.json implies {} (samples {}, bucket {}x{}, autoencoder "
            "{})",
            path, name, shape_str(entry->shape), shape_str(shape), shard.samples, shard.width, shard.height,
            m.autoencoder);
      *slots[t] = entry;
    }
    files_->shards.push_back(std::move(opened));
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
                           const Tensor& pooled) const {
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
  check_shape(latents, {n, m.latent_channels, first.latent_height, first.latent_width}, "FLUX cache latents");
  check_shape(text, {n, m.text_tokens, m.context_dim}, "FLUX cache prompt_embeds");
  check_shape(pooled, {n, m.pooled_dim}, "FLUX cache pooled_prompt_embeds");
  const SafetensorsDType from = stored_dtype(m.dtype);
  const size_t from_size = safetensors_dtype_size(from);
  const Tensor* outs[] = {&latents, &text, &pooled};
  for (size_t t = 0; t < 3; ++t) {
    const Tensor& out = *outs[t];
    FORGE_CHECK(out.dtype() == DType::F32 || out.dtype() == DType::BF16, "FLUX cache read into {}: fp32 or bf16",
                dtype_name(out.dtype()));
    const int64_t row = out.numel() / n;
    const Tensor host = out.device() == Device::CPU ? out : Tensor::empty(out.shape(), out.dtype());
    uint8_t* dst = static_cast<uint8_t*>(host.raw());
    for (int64_t k = 0; k < n; ++k) {
      const Files::Shard& shard = files_->shards[static_cast<size_t>(where[static_cast<size_t>(k)].first)];
      const SafetensorsEntry* entry = t == 0 ? shard.latents : t == 1 ? shard.text : shard.pooled;
      const uint8_t* src =
          shard.file->bytes(*entry) + static_cast<size_t>(where[static_cast<size_t>(k)].second * row) * from_size;
      convert_values(dst + static_cast<size_t>(k * row) * dtype_size(out.dtype()), out.dtype(), src, from, row);
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
          name == kManifestName || name == kCaptionsName ||
          (name.rfind("shard-", 0) == 0 && name.size() > 12 && name.substr(name.size() - 12) == ".safetensors");
      if (!cache_file || !e.is_regular_file()) only_cache_files = false;
    }
    if (!empty) {
      if (!is_flux_latent_cache(folder) || !only_cache_files)
        FORGE_FAIL(
            "{} exists and is not a FLUX latent cache (cache.json, captions.jsonl and shard files only): "
            "refusing to replace it; choose another --output",
            folder);
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
  FORGE_CHECK(o.max_shard_samples > 0 && o.max_shard_bytes > 0, "FLUX cache writer: shard limits {} samples, {} bytes",
              o.max_shard_samples, o.max_shard_bytes);
  manifest_.autoencoder = o.autoencoder;
  manifest_.latent_channels = o.latent_channels;
  manifest_.text_tokens = o.text_tokens;
  manifest_.context_dim = o.context_dim;
  manifest_.pooled_dim = o.pooled_dim;
  manifest_.dtype = o.dtype;
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
  check_shape(latents, {n, manifest_.latent_channels, height / f, width / f}, "FLUX cache latents");
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
    row(latents_, l, latents.numel() / n);
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
  write_safetensors(
      path,
      {{"latents", {n, manifest_.latent_channels, shard.latent_height, shard.latent_width}, latents_.data()},
       {"prompt_embeds", {n, manifest_.text_tokens, manifest_.context_dim}, text_.data()},
       {"pooled_prompt_embeds", {n, manifest_.pooled_dim}, pooled_.data()}},
      stored_dtype(manifest_.dtype), {{"format", kFluxCacheFormat}});
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
  text_.clear();
  pooled_.clear();
  images_.clear();
  open_captions_.clear();
}

FluxCacheManifest FluxLatentCacheWriter::finish() {
  FORGE_CHECK(!finished_, "FLUX cache writer: finish called twice");
  write_open_shard();
  if (manifest_.samples == 0) FORGE_FAIL("{}: no samples to write", directory_.path());
  const DurableOptions options{.sync = false};
  write_file_atomic(join(directory_.temporary_path(), kCaptionsName), captions_, options);
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
