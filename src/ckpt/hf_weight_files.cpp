#include "ckpt/hf_weight_files.h"

#include <filesystem>
#include <map>

#include "core/json_input.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

// A shard's name in the index: one file name in the model's directory, no longer than a
// file name may be (NAME_MAX, 255 bytes on Linux), so that looking it up can only find or
// not find it.
bool is_plain_file_name(const std::string& name) {
  constexpr size_t kMaxFileNameBytes = 255;
  return !name.empty() && name.size() <= kMaxFileNameBytes && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos && name != "." && name != "..";
}

}  // namespace

HfWeightFiles::HfWeightFiles(const std::string& dir, const std::string& base) {
  if (!fs::is_directory(dir)) FORGE_FAIL("'{}' is not a directory (expected a Hugging Face model directory)", dir);
  const std::string single_name = base + ".safetensors", index_name = base + ".safetensors.index.json";
  const std::string single = (fs::path(dir) / single_name).string();
  const std::string index = (fs::path(dir) / index_name).string();
  if (fs::exists(single)) {
    files_.push_back(std::make_unique<SafetensorsFile>(single));
  } else if (fs::exists(index)) {
    open_index(dir, index);
  } else if (fs::exists(fs::path(dir) / "pytorch_model.bin") || fs::exists(fs::path(dir) / "pytorch_model.bin.index.json")) {
    FORGE_FAIL("'{}' holds PyTorch .bin weights only; forge reads safetensors (re-save the model with "
               "save_pretrained(..., safe_serialization=True))",
               dir);
  } else {
    FORGE_FAIL("'{}' has neither {} nor {}", dir, single_name, index_name);
  }
}

void HfWeightFiles::open_index(const std::string& dir, const std::string& index_path) {
  nlohmann::json index = read_json_file(index_path, "the weight index");
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    FORGE_FAIL("{}: expected an object with a \"weight_map\" object", index_path);
  std::map<std::string, std::string> tensor_to_file;
  std::map<std::string, size_t> file_slot;
  for (const auto& [tensor, file] : index["weight_map"].items()) {
    if (!file.is_string() || !is_plain_file_name(file.get<std::string>()))
      FORGE_FAIL("{}: weight_map[\"{}\"] is {}, expected a file name in the same directory (at most 255 bytes)",
                 index_path, tensor,
                 describe_json(file));
    const std::string name = file.get<std::string>();
    tensor_to_file[tensor] = name;
    if (file_slot.emplace(name, files_.size()).second) {
      const std::string path = (fs::path(dir) / name).string();
      if (!fs::exists(path)) FORGE_FAIL("{}: shard '{}' (holding '{}') does not exist", index_path, name, tensor);
      files_.push_back(std::make_unique<SafetensorsFile>(path));
    }
  }
  if (files_.empty()) FORGE_FAIL("{}: \"weight_map\" is empty", index_path);
  for (const auto& [tensor, name] : tensor_to_file)
    if (files_[file_slot[name]]->find(tensor) == nullptr)
      FORGE_FAIL("{}: maps '{}' to '{}', which does not hold it", index_path, tensor, name);
  for (const auto& [name, slot] : file_slot)
    for (const auto& entry : files_[slot]->entries()) {
      auto it = tensor_to_file.find(entry.name);
      if (it == tensor_to_file.end() || it->second != name)
        FORGE_FAIL("{}: shard '{}' holds '{}', which the index maps to {}", index_path, name, entry.name,
                   it == tensor_to_file.end() ? std::string("no file") : "'" + it->second + "'");
    }
}

LocatedTensor HfWeightFiles::find(const std::string& name) const {
  for (const auto& f : files_)
    if (const SafetensorsEntry* e = f->find(name)) return {f.get(), e};
  return {};
}

std::vector<LocatedTensor> HfWeightFiles::all() const {
  std::vector<LocatedTensor> out;
  for (const auto& f : files_)
    for (const auto& e : f->entries()) out.push_back({f.get(), &e});
  return out;
}

}  // namespace forge
