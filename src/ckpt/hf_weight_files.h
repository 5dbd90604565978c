// The safetensors files of a Hugging Face model directory, and which file holds which
// tensor.
//
// As transformers (and, with another stem, diffusers) looks for them: model.safetensors if
// present, else the shards named by model.safetensors.index.json ("weight_map": tensor name → file name). The index is
// checked against the shards: every file it names must exist (a plain file name inside the
// directory, nothing that climbs out of it), every tensor it maps must be in the file it
// names, and every tensor in a shard must be mapped to that shard.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"

namespace forge {

struct LocatedTensor {
  const SafetensorsFile* file = nullptr;
  const SafetensorsEntry* entry = nullptr;
};

class HfWeightFiles {
 public:
  // Throws forge::Error naming the directory or file when the weights are missing or the
  // index disagrees with the shards.
  // `base`: the files' stem, "model" for transformers (model.safetensors), and
  // "diffusion_pytorch_model" for diffusers' model folders.
  explicit HfWeightFiles(const std::string& dir, const std::string& base = "model");

  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  // file == nullptr when no file holds the tensor.
  LocatedTensor find(const std::string& name) const;
  // Every tensor of every file.
  std::vector<LocatedTensor> all() const;

 private:
  void open_index(const std::string& dir, const std::string& index_path);

  std::vector<std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace forge
