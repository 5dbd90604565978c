#include "ckpt/hf_export.h"

#include <filesystem>

#include "ckpt/hf_config.h"
#include "ckpt/hf_layout.h"
#include "core/json_input.h"
#include "core/durable_directory.h"
#include "core/log.h"

namespace forge {

SafetensorsDType export_safetensors_dtype(const std::string& export_dtype) {
  if (export_dtype == "bf16") return SafetensorsDType::BF16;
  if (export_dtype == "fp16") return SafetensorsDType::F16;
  FORGE_CHECK(export_dtype == "fp32", "checkpoint.export_dtype '{}': expected bf16, fp16 or fp32", export_dtype);
  return SafetensorsDType::F32;
}

namespace {

namespace fs = std::filesystem;

// Files of the source model that describe its tokenizer and generation defaults, not its
// weights: they belong with any model trained from it.
constexpr const char* kCompanionFiles[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                                           "tokenizer.model", "generation_config.json"};
// Exports are not flushed to disk: NOTE [Durable files] in core/durable_file.h says why.
constexpr DurableOptions kExportDurability{.sync = false};

// The source model's config.json, its family and how its weights are stored; empty, "" and
// the default layout without one.
struct SourceConfig {
  nlohmann::json config;
  std::string family;
  HfWeightLayout layout;
};

SourceConfig read_source_config(const std::string& source_dir) {
  SourceConfig source;
  const fs::path path = fs::path(source_dir) / "config.json";
  if (source_dir.empty() || !fs::exists(path)) return source;
  source.config = read_json_file(path.string(), "the source model's config.json");
  source.family = hf_model_family(source.config, path.string());
  source.layout = hf_weight_layout(source.config, path.string());
  return source;
}

std::vector<SafetensorsTensorRef> hf_tensors(const FlatParameters& params, const HfWeightLayout& layout) {
  std::vector<SafetensorsTensorRef> out;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const float* data = params.tensors()[i].data<float>();
    for (HfPart& part : hf_parts(params.specs()[i], layout.interleaved_rotary))
      out.push_back({part.name, part.shape, data + part.offset, std::move(part.row_order),
                     part.keep_fp32 ? std::optional(SafetensorsDType::F32) : std::nullopt});
  }
  for (const HfPart& part : hf_empty_parts(params.config())) out.push_back({part.name, part.shape, nullptr});
  return out;
}

uint64_t stored_bytes(const SafetensorsTensorRef& t, SafetensorsDType dtype) {
  return static_cast<uint64_t>(shape_numel(t.shape)) * safetensors_dtype_size(t.stored.value_or(dtype));
}

// Consecutive runs of tensors of at most max_bytes each (a larger tensor gets a shard of
// its own), as save_pretrained splits them.
std::vector<std::vector<SafetensorsTensorRef>> split_into_shards(const std::vector<SafetensorsTensorRef>& tensors,
                                                                 SafetensorsDType dtype, uint64_t max_bytes) {
  std::vector<std::vector<SafetensorsTensorRef>> shards(1);
  uint64_t bytes = 0;
  for (const auto& t : tensors) {
    const uint64_t size = stored_bytes(t, dtype);
    if (!shards.back().empty() && bytes + size > max_bytes) {
      shards.emplace_back();
      bytes = 0;
    }
    shards.back().push_back(t);
    bytes += size;
  }
  return shards;
}

void write_weights(const fs::path& dir, const FlatParameters& params, const HfExportOptions& options,
                   const HfWeightLayout& layout) {
  const std::map<std::string, std::string> metadata = {{"format", "pt"}};
  auto shards = split_into_shards(hf_tensors(params, layout), options.dtype, options.max_shard_bytes);
  if (shards.size() == 1) {
    write_safetensors((dir / "model.safetensors").string(), shards[0], options.dtype, metadata);
    return;
  }
  nlohmann::json weight_map = nlohmann::json::object();
  uint64_t total_bytes = 0;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    write_safetensors((dir / file).string(), shards[s], options.dtype, metadata);
    for (const auto& t : shards[s]) {
      weight_map[t.name] = file;
      total_bytes += stored_bytes(t, options.dtype);
    }
  }
  nlohmann::json index = {
      {"metadata", {{"total_parameters", params.config().total_params()}, {"total_size", total_bytes}}},
      {"weight_map", weight_map}};
  write_file_atomic((dir / "model.safetensors.index.json").string(), index.dump(2) + "\n", kExportDurability);
}

const char* torch_dtype_name(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::BF16: return "bfloat16";
    case SafetensorsDType::F16: return "float16";
    default: return "float32";
  }
}

// NOTE [Export keeps the source's config] in hf_export.h.
// Returns the architecture class written.
std::string write_config(const fs::path& dir, const FlatParameters& params, const HfExportOptions& options,
                         const SourceConfig& source) {
  nlohmann::ordered_json config =
      source.config.is_null() ? nlohmann::ordered_json() : nlohmann::ordered_json::parse(source.config.dump());
  const nlohmann::ordered_json written =
      hf_config_from_model(params.config(), torch_dtype_name(options.dtype), source.family, source.layout);
  for (const auto& [key, value] : written.items()) config[key] = value;
  write_file_atomic((dir / "config.json").string(), config.dump(2) + "\n", kExportDurability);
  return config["architectures"][0].get<std::string>();
}

void copy_companion_files(const fs::path& dir, const std::string& source_dir) {
  for (const char* name : kCompanionFiles) {
    const fs::path from = fs::path(source_dir) / name;
    if (!fs::exists(from)) continue;
    std::error_code ec;
    fs::copy_file(from, dir / name, ec);
    if (ec) FORGE_FAIL("cannot copy '{}' to '{}': {}", from.string(), (dir / name).string(), ec.message());
  }
}

}  // namespace

void check_hf_export_target(const std::string& dir) {
  const fs::path target(dir);
  if (fs::exists(target) && !fs::is_directory(target))
    FORGE_FAIL("cannot export the Hugging Face model to '{}': it exists and is not a directory", dir);
  if (fs::is_directory(target) && !fs::is_empty(target))
    FORGE_FAIL("cannot export the Hugging Face model to '{}': the directory exists and is not empty (refusing to "
               "overwrite it)",
               dir);
}

void check_hf_exportable(const ModelConfig& config, const std::string& source_dir) {
  const SourceConfig source = read_source_config(source_dir);
  hf_config_from_model(config, "float32", source.family, source.layout);
}

void save_hf_model(const std::string& dir, const FlatParameters& params, const HfExportOptions& options) {
  FORGE_CHECK(options.dtype == SafetensorsDType::F32 || options.dtype == SafetensorsDType::BF16 ||
                  options.dtype == SafetensorsDType::F16,
              "Hugging Face export stores F32, BF16 or F16, not {}", safetensors_dtype_name(options.dtype));
  FORGE_CHECK(options.max_shard_bytes > 0, "max_shard_bytes must be positive");
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "Hugging Face export reads fp32 weights in host memory");
  fs::path target = fs::path(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  if (target.empty()) FORGE_FAIL("Hugging Face export: no target directory given");
  check_hf_export_target(target.string());
  if (!options.source_dir.empty() && !fs::is_directory(options.source_dir))
    FORGE_FAIL("Hugging Face export: source model directory '{}' does not exist", options.source_dir);

  std::error_code ec;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  if (ec) FORGE_FAIL("cannot create '{}': {}", target.parent_path().string(), ec.message());
  const SourceConfig source = read_source_config(options.source_dir);
  hf_config_from_model(params.config(), "float32", source.family, source.layout);  // refuses before writing
  AtomicDirectory staging(target.string(), kExportDurability);
  const fs::path temp = staging.temporary_path();
  write_weights(temp, params, options, source.layout);
  const std::string architecture = write_config(temp, params, options, source);
  if (!options.source_dir.empty()) copy_companion_files(temp, options.source_dir);
  staging.commit();  // replaces an empty target directory, checked above
  log_info("exported the model as Hugging Face {} ({}) to {}", architecture, safetensors_dtype_name(options.dtype),
           target.string());
}

}  // namespace forge
