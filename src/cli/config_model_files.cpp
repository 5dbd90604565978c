// Model file search; see config_model_files.h.
#include "cli/config_model_files.h"

#include <algorithm>
#include <cstdlib>
#include <system_error>

namespace forge {

namespace fs = std::filesystem;

std::vector<fs::path> model_search_dirs(const std::string& experiment_path) {
  std::vector<fs::path> dirs;
  auto add = [&](const fs::path& dir) {
    const fs::path normal = dir.lexically_normal();
    if (std::find(dirs.begin(), dirs.end(), normal) == dirs.end()) dirs.push_back(normal);
  };
  if (const char* config_dir = std::getenv("FORGE_CONFIG_DIR"); config_dir && *config_dir) {
    add(fs::path(config_dir) / "models");
  }
  if (!experiment_path.empty()) {
    for (fs::path dir = fs::absolute(experiment_path).parent_path();; dir = dir.parent_path()) {
      std::error_code unreadable_counts_as_absent;
      if (fs::is_directory(dir / "configs" / "models", unreadable_counts_as_absent)) add(dir / "configs" / "models");
      if (!dir.has_relative_path()) break;
    }
  }
  add(fs::path(FORGE_SOURCE_DIR) / "configs" / "models");
  return dirs;
}

std::optional<fs::path> find_model_file(const std::string& name, const std::vector<fs::path>& dirs) {
  for (const auto& dir : dirs) {
    const fs::path file = dir / (name + ".yaml");
    std::error_code error;
    if (fs::is_regular_file(file, error)) return file;
  }
  return std::nullopt;
}

std::vector<std::string> available_models(const std::vector<fs::path>& dirs) {
  std::vector<std::string> names;
  for (const auto& dir : dirs) {
    std::error_code error;
    for (const auto& entry : fs::directory_iterator(dir, error)) {
      if (entry.path().extension() == ".yaml") names.push_back(entry.path().stem().string());
    }
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

}  // namespace forge
