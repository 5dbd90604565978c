#include "ckpt/initial_load.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_metadata.h"
#include "ckpt/hf_config.h"
#include "core/error.h"

namespace forge {
namespace {

namespace fs = std::filesystem;

constexpr const char* kExpected =
    "expected a forge checkpoint (a step-<N> directory holding metadata.json, or a folder of them) or a Hugging "
    "Face model directory (config.json with model.safetensors or model.safetensors.index.json)";

// "holds a.txt, b/, c.bin and 4 more" or "is empty", for the error.
std::string contents(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code error;
  for (fs::directory_iterator it(dir, error), end; !error && it != end; it.increment(error))
    names.push_back(it->path().filename().string() + (it->is_directory(error) ? "/" : ""));
  if (error) return fmt::format("cannot be listed ({})", error.message());
  if (names.empty()) return "is empty";
  std::sort(names.begin(), names.end());
  constexpr size_t kShown = 6;
  const size_t more = names.size() > kShown ? names.size() - kShown : 0;
  names.resize(std::min(names.size(), kShown));
  return fmt::format("holds {}{}", fmt::join(names, ", "), more ? fmt::format(" and {} more", more) : "");
}

}  // namespace

InitialLoadKind classify_initial_load(const std::string& path, const std::string& key) {
  std::error_code error;
  if (!fs::exists(path, error)) FORGE_FAIL("{}: '{}' does not exist ({})", key, path, kExpected);
  if (!fs::is_directory(path, error)) FORGE_FAIL("{}: '{}' is not a directory ({})", key, path, kExpected);
  if (fs::exists(fs::path(path) / kCheckpointMetadataFile, error) || !checkpoint_steps(path).empty())
    return InitialLoadKind::ForgeCheckpoint;
  if (is_hf_model_dir(path)) return InitialLoadKind::HuggingFace;
  FORGE_FAIL("{}: '{}' is neither a forge checkpoint nor a Hugging Face model: it has no {} and no config.json, and "
             "{} ({})",
             key, path, kCheckpointMetadataFile, contents(path), kExpected);
}

}  // namespace forge
