#include "ckpt/hf_export.h"

#include <cctype>
#include <filesystem>
#include <span>

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

uint64_t export_max_shard_bytes(const std::string& text, uint64_t default_bytes, const std::string& key) {
  if (text.empty()) return default_bytes;
  size_t digits = 0;
  while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
  const std::string number = text.substr(0, digits), unit = text.substr(digits);
  struct Unit {
    const char* name;
    uint64_t multiplier;
    bool bits;
  };
  static constexpr Unit kUnits[] = {
      {"", 1, false},           {"KB", 1'000, false},     {"MB", 1'000'000, false}, {"GB", 1'000'000'000, false},
      {"KiB", 1ull << 10, false}, {"MiB", 1ull << 20, false}, {"GiB", 1ull << 30, false}, {"Kb", 1'000, true},
      {"Mb", 1'000'000, true},  {"Gb", 1'000'000'000, true}};
  const Unit* found = nullptr;
  for (const Unit& u : kUnits)
    if (unit == u.name) found = &u;
  if (unit == "kb" || unit == "mb" || unit == "gb")
    FORGE_FAIL("{} '{}': the unit '{}' is ambiguous (transformers reads it as bits); write {} for bytes, or {} for "
               "bits",
               key, text, unit, unit == "kb" ? "KB" : unit == "mb" ? "MB" : "GB",
               unit == "kb" ? "Kb" : unit == "mb" ? "Mb" : "Gb");
  if (number.empty() || !found || number.size() > 12)
    FORGE_FAIL("{} '{}': expected a whole number of bytes, or one with a unit (KB, MB, GB, KiB, MiB, GiB, or Kb, Mb, "
               "Gb for bits), such as 5GB or 2000MB",
               key, text);
  const uint64_t bytes = std::stoull(number) * found->multiplier / (found->bits ? 8 : 1);
  if (bytes == 0) FORGE_FAIL("{} '{}': a shard must hold at least one byte", key, text);
  return bytes;
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

const char* torch_dtype_name(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::BF16: return "bfloat16";
    case SafetensorsDType::F16: return "float16";
    default: return "float32";
  }
}

// NOTE [Export keeps the source's config] in hf_export.h.
// Returns the architecture class written.
std::string write_config(const fs::path& dir, const ModelConfig& model, const HfExportOptions& options,
                         const SourceConfig& source) {
  nlohmann::ordered_json config =
      source.config.is_null() ? nlohmann::ordered_json() : nlohmann::ordered_json::parse(source.config.dump());
  const nlohmann::ordered_json written =
      hf_config_from_model(model, torch_dtype_name(options.dtype), source.family, source.layout);
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

// model.safetensors.index.json of a sharded export, as save_pretrained writes it.
void write_index(const fs::path& dir, const ModelConfig& model, const HfExportPlan& plan) {
  write_file_atomic((dir / plan.index_name()).string(), plan.index_json({{"total_parameters", model.total_params()}}),
                    kExportDurability);
}

// The export's directory as given, without a trailing separator.
std::string export_target(const std::string& dir) {
  fs::path target = fs::path(dir).lexically_normal();
  if (!target.has_filename()) target = target.parent_path();
  if (target.empty()) FORGE_FAIL("Hugging Face export: no target directory given");
  return target.string();
}

// Checks the target and the source and creates the target's parent; returns the target.
std::string prepare_target(const std::string& dir, const ModelConfig& model, const HfExportOptions& options) {
  FORGE_CHECK(options.dtype == SafetensorsDType::F32 || options.dtype == SafetensorsDType::BF16 ||
                  options.dtype == SafetensorsDType::F16,
              "Hugging Face export stores F32, BF16 or F16, not {}", safetensors_dtype_name(options.dtype));
  FORGE_CHECK(options.max_shard_bytes > 0, "max_shard_bytes must be positive");
  const fs::path target = export_target(dir);
  check_hf_export_target(target.string());
  if (!options.source_dir.empty() && !fs::is_directory(options.source_dir))
    FORGE_FAIL("Hugging Face export: source model directory '{}' does not exist", options.source_dir);
  std::error_code ec;
  if (target.has_parent_path()) fs::create_directories(target.parent_path(), ec);
  if (ec) FORGE_FAIL("cannot create '{}': {}", target.parent_path().string(), ec.message());
  const SourceConfig source = read_source_config(options.source_dir);
  hf_config_from_model(model, "float32", source.family, source.layout);  // refuses before writing
  return target.string();
}

}  // namespace

HfExportPlan hf_export_plan(const ModelConfig& config, const HfExportOptions& options) {
  const SourceConfig source = read_source_config(options.source_dir);
  return HfExportPlan(config, options.dtype, options.max_shard_bytes, source.layout.interleaved_rotary);
}

std::string hf_export_temporary_path(const std::string& dir, int64_t token) {
  return fmt::format("{}.tmp-export-{}", export_target(dir), token);
}

HfExportDirectory::HfExportDirectory(const std::string& dir, const ModelConfig& config, const HfExportOptions& options,
                                     const std::string& temporary)
    : config_(config),
      options_(options),
      target_(prepare_target(dir, config, options)),
      plan_(hf_export_plan(config, options)) {
  staging_ = temporary.empty() ? std::make_unique<AtomicDirectory>(target_, kExportDurability)
                               : std::make_unique<AtomicDirectory>(target_, temporary, kExportDurability);
  plan_.create_files(staging_->temporary_path());
}

HfExportDirectory::~HfExportDirectory() = default;

const std::string& HfExportDirectory::temporary_path() const { return staging_->temporary_path(); }

void HfExportDirectory::commit() {
  const fs::path temp = staging_->temporary_path();
  if (plan_.files().size() > 1) write_index(temp, config_, plan_);
  const SourceConfig source = read_source_config(options_.source_dir);
  const std::string architecture = write_config(temp, config_, options_, source);
  if (!options_.source_dir.empty()) copy_companion_files(temp, options_.source_dir);
  staging_->commit();  // replaces an empty target directory, checked before
  log_info("exported the model as Hugging Face {} ({}) to {}", architecture, safetensors_dtype_name(options_.dtype),
           target_);
}

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
  FORGE_CHECK(params.flat().device() == Device::CPU && params.flat().dtype() == DType::F32,
              "Hugging Face export reads fp32 weights in host memory");
  HfExportDirectory out(dir, params.config(), options);
  FORGE_CHECK(params.specs().size() == out.plan().specs().size() && params.flat().numel() == out.plan().numel(),
              "Hugging Face export writes the whole model: {} parameters of {} elements given, the model has {} of {}",
              params.specs().size(), params.flat().numel(), out.plan().specs().size(), out.plan().numel());
  HfExportWriter writer(out.plan(), out.temporary_path());
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const Tensor& t = params.tensors()[i];
    writer.write(i, std::span<const float>(t.data<float>(), static_cast<size_t>(t.numel())));
  }
  writer.close();
  out.commit();
}

}  // namespace forge
