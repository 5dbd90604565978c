// The T5 encoder's weights from a transformers folder; see t5_weights.h.
#include "ckpt/t5_weights.h"

#include <filesystem>
#include <set>
#include <vector>

#include "ckpt/hf_weight_files.h"
#include "core/error.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

constexpr const char* kShared = "shared.weight";
constexpr const char* kEmbedTokens = "encoder.embed_tokens.weight";

std::string describe(const T5Config& c) {
  return fmt::format(
      "the T5 encoder of {} layers, d_model {}, {} heads of {}, "
      "d_ff {}, vocabulary {}",
      c.num_layers, c.d_model, c.num_heads, c.d_kv, c.d_ff, c.vocab_size);
}

}  // namespace

std::string t5_encoder_folder(const std::string& path) {
  std::error_code error;
  FORGE_CHECK(fs::is_directory(path, error),
              "T5 encoder '{}' not found: expected a transformers "
              "T5EncoderModel folder (config.json and "
              "model.safetensors or its index), or a FLUX pipeline folder "
              "holding one as text_encoder_2/",
              path);
  const fs::path sub = fs::path(path) / "text_encoder_2";
  if (!fs::exists(fs::path(path) / "config.json", error) && fs::is_directory(sub, error)) return sub.string();
  return path;
}

void load_t5_weights(const std::string& folder, const T5Weights& weights) {
  const T5Config& c = weights.config();
  const HfWeightFiles files(folder, "model");
  const std::vector<T5TensorSpec>& specs = weights.specs();

  // Which file tensor fills each spec; every other file tensor is an error.
  std::set<std::string> known{kEmbedTokens};
  for (const T5TensorSpec& s : specs) known.insert(s.name);
  for (const LocatedTensor& t : files.all())
    if (!known.contains(t.entry->name))
      FORGE_FAIL(
          "{}: tensor '{}' has no place in {} (a decoder's, another "
          "layer count's or another "
          "architecture's weights?)",
          t.file->path(), t.entry->name, describe(c));
  auto check_shape_of = [&](const LocatedTensor& t, const Shape& shape) {
    if (t.entry->shape != shape)
      FORGE_FAIL("{}: '{}' is {}, {} needs {}", t.file->path(), t.entry->name, shape_str(t.entry->shape), describe(c),
                 shape_str(shape));
  };
  std::vector<LocatedTensor> sources;
  for (const T5TensorSpec& s : specs) {
    LocatedTensor t = files.find(s.name);
    if (s.name == kShared) {
      const LocatedTensor tied = files.find(kEmbedTokens);
      if (tied.file) check_shape_of(tied, s.shape);
      if (!t.file) t = tied;
      if (!t.file)
        FORGE_FAIL(
            "{}: no embedding: neither '{}' nor '{}' is there, and {} "
            "needs one",
            folder, kShared, kEmbedTokens, describe(c));
    }
    if (!t.file) FORGE_FAIL("{}: no tensor '{}', which {} needs", folder, s.name, describe(c));
    check_shape_of(t, s.shape);
    sources.push_back(t);
  }

  std::vector<float> staging;
  for (size_t i = 0; i < specs.size(); ++i) {
    const Tensor& dst = weights.tensors()[i];
    if (dst.device() == Device::CPU && dst.dtype() == DType::F32) {
      sources[i].file->read_as_float(*sources[i].entry, dst.data<float>());
      continue;
    }
    staging.resize(static_cast<size_t>(dst.numel()));
    sources[i].file->read_as_float(*sources[i].entry, staging.data());
    weights.write(i, staging.data());
  }
}

T5Weights load_t5_encoder(const std::string& path, Device device, DType dtype) {
  const std::string folder = t5_encoder_folder(path);
  const T5Config config = read_t5_config((fs::path(folder) / "config.json").string());
  T5Weights weights(config, device, dtype);
  load_t5_weights(folder, weights);
  return weights;
}

}  // namespace forge
