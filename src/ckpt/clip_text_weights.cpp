// CLIP text encoder weights; see clip_text_weights.h (NOTE [CLIP text weight files]).
#include "ckpt/clip_text_weights.h"

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>

#include "ckpt/hf_weight_files.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

constexpr const char* kLegacyPrefix = "text_model.";
constexpr const char* kPositionIds = "embeddings.position_ids";

bool has_weights(const fs::path& dir) {
  return fs::exists(dir / "model.safetensors") || fs::exists(dir / "model.safetensors.index.json");
}

// Where the encoder's files are: a folder with its config.json, or one file.
struct Location {
  std::string folder;  // empty for a lone file
  std::string file;    // the lone file
  std::string config;  // config.json, or empty (a lone file without one: CLIP-L)
};

Location locate(const std::string& path) {
  std::error_code error;
  Location l;
  if (fs::is_directory(path, error)) {
    fs::path dir = path;
    if (!has_weights(dir) && fs::is_directory(dir / "text_encoder", error)) dir /= "text_encoder";
    if (!has_weights(dir))
      FORGE_FAIL("'{}' holds neither model.safetensors nor model.safetensors.index.json{}: expected a CLIPTextModel "
                 "folder (FLUX.1's text_encoder/) or a folder holding one as text_encoder/",
                 dir.string(), dir.string() == path ? " nor a text_encoder/ folder" : "");
    l.folder = dir.string();
    l.config = (dir / "config.json").string();
    if (!fs::is_regular_file(l.config, error))
      FORGE_FAIL("'{}' has no config.json (a CLIPTextModel folder needs one)", l.folder);
    return l;
  }
  FORGE_CHECK(fs::is_regular_file(path, error),
              "CLIP text encoder '{}' not found: expected a CLIPTextModel folder (FLUX.1's text_encoder/), a folder "
              "holding one, or a .safetensors file",
              path);
  l.file = path;
  const fs::path beside = fs::path(path).parent_path() / "config.json";
  if (fs::is_regular_file(beside, error)) l.config = beside.string();
  return l;
}

// The position_ids buffer must be 0, 1, ..., P - 1 as [1, P] (or [P]) integers.
void check_position_ids(const SafetensorsFile& file, const SafetensorsEntry& e, int64_t positions) {
  const bool shape_ok = e.shape == Shape{1, positions} || e.shape == Shape{positions};
  const bool dtype_ok = e.dtype == SafetensorsDType::I64 || e.dtype == SafetensorsDType::I32;
  if (!shape_ok || !dtype_ok)
    FORGE_FAIL("{}: '{}' is {} {}, expected the position ids 0 .. {} as I64 [1, {}]", file.path(), e.name,
               safetensors_dtype_name(e.dtype), shape_str(e.shape), positions - 1, positions);
  const uint8_t* bytes = file.bytes(e);
  for (int64_t i = 0; i < positions; ++i) {
    int64_t v = 0;
    if (e.dtype == SafetensorsDType::I64) {
      std::memcpy(&v, bytes + i * 8, 8);
    } else {
      int32_t v32 = 0;
      std::memcpy(&v32, bytes + i * 4, 4);
      v = v32;
    }
    if (v != i)
      FORGE_FAIL("{}: '{}' holds {} at index {}, expected the position ids 0, 1, 2, ...", file.path(), e.name, v, i);
  }
}

// The model the parameters were made for must be the one config.json describes.
void check_config_agrees(const std::string& path, const ClipTextConfig& file, const ClipTextConfig& model) {
  auto expect = [&](const char* key, auto have, auto want) {
    if (have != want) FORGE_FAIL("{}: \"{}\" is {}, the CLIP text encoder being loaded ({}) has {}", path, key, have,
                                 model.name, want);
  };
  expect("vocab_size", file.vocab_size, model.vocab_size);
  expect("hidden_size", file.hidden_size, model.hidden_size);
  expect("intermediate_size", file.intermediate_size, model.intermediate_size);
  expect("num_hidden_layers", file.num_layers, model.num_layers);
  expect("num_attention_heads", file.num_heads, model.num_heads);
  expect("max_position_embeddings", file.max_positions, model.max_positions);
  expect("hidden_act", clip_activation_name(file.activation), clip_activation_name(model.activation));
  expect("layer_norm_eps", file.layer_norm_eps, model.layer_norm_eps);
  expect("eos_token_id", file.eos_token_id, model.eos_token_id);
}

}  // namespace

ClipTextConfig read_clip_text_encoder_config(const std::string& path) {
  const Location l = locate(path);
  return l.config.empty() ? clip_l_text_config() : read_clip_text_config(l.config);
}

void load_clip_text_weights(const std::string& path, ClipTextParameters& params) {
  FORGE_CHECK(params.tensors().front().device() == Device::CPU && params.tensors().front().dtype() == DType::F32,
              "load_clip_text_weights: the parameters must be fp32 on the CPU");
  const ClipTextConfig& c = params.config();
  const Location l = locate(path);
  if (!l.config.empty()) check_config_agrees(l.config, read_clip_text_config(l.config), c);
  std::unique_ptr<HfWeightFiles> folder;
  std::unique_ptr<SafetensorsFile> single;
  std::vector<LocatedTensor> everything;
  if (!l.folder.empty()) {
    folder = std::make_unique<HfWeightFiles>(l.folder, "model");
    everything = folder->all();
  } else {
    single = std::make_unique<SafetensorsFile>(l.file);
    for (const SafetensorsEntry& e : single->entries()) everything.push_back({single.get(), &e});
  }
  const std::string where = l.folder.empty() ? l.file : l.folder;
  FORGE_CHECK(!everything.empty(), "{}: no tensors (expected the CLIP text encoder's)", where);

  // One naming for all: transformers 5's, or transformers 4's with "text_model." in front.
  const bool legacy = everything.front().entry->name.starts_with(kLegacyPrefix);
  const std::string prefix = legacy ? kLegacyPrefix : "";
  std::map<std::string, LocatedTensor> by_name;
  for (const LocatedTensor& t : everything) {
    const std::string& name = t.entry->name;
    if (name.starts_with(kLegacyPrefix) != legacy)
      FORGE_FAIL("{}: tensor '{}' is named {} \"text_model.\" where '{}' is named {} it: a file's names must all "
                 "be transformers 4's (with the prefix) or all transformers 5's (without)",
                 t.file->path(), name, legacy ? "without" : "with", everything.front().entry->name,
                 legacy ? "with" : "without");
    by_name[name.substr(prefix.size())] = t;
  }

  const std::vector<ClipTextParameterSpec>& specs = params.specs();
  for (size_t i = 0; i < specs.size(); ++i) {
    const std::string file_name = prefix + specs[i].name;
    auto it = by_name.find(specs[i].name);
    if (it == by_name.end())
      FORGE_FAIL("{}: no tensor '{}', which the CLIP text encoder ({}) needs", where, file_name, c.name);
    const SafetensorsEntry& e = *it->second.entry;
    if (e.shape != specs[i].shape)
      FORGE_FAIL("{}: '{}' is {}, the CLIP text encoder ({}) needs {}", it->second.file->path(), file_name,
                 shape_str(e.shape), c.name, shape_str(specs[i].shape));
    if (e.dtype != SafetensorsDType::F32 && e.dtype != SafetensorsDType::BF16 && e.dtype != SafetensorsDType::F16)
      FORGE_FAIL("{}: '{}' is stored as {}, expected F32, BF16 or F16", it->second.file->path(), file_name,
                 safetensors_dtype_name(e.dtype));
  }
  std::map<std::string, bool> known;
  for (const ClipTextParameterSpec& s : specs) known[s.name] = true;
  for (const auto& [name, t] : by_name) {
    if (known.contains(name)) continue;
    if (name == kPositionIds) {
      check_position_ids(*t.file, *t.entry, c.max_positions);
      continue;
    }
    FORGE_FAIL("{}: tensor '{}' has no place in the CLIP text encoder ({}, {} layers): a CLIPModel's vision tower, "
               "a text projection, or another model's weights?",
               t.file->path(), t.entry->name, c.name, c.num_layers);
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    const LocatedTensor& t = by_name.at(specs[i].name);
    t.file->read_as_float(*t.entry, params.tensors()[i].data<float>());
  }
}

}  // namespace forge
