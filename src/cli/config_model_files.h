// Finding model files: configs/models/<name>.yaml in a list of search directories, and
// the names available there for "model 'x' not found" messages.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace forge {

// In order: $FORGE_CONFIG_DIR/models (when set), configs/models in each ancestor of the
// experiment file's directory that has one (nearest first; none for an empty path), and
// the source tree's configs/models. Duplicates removed.
std::vector<std::filesystem::path> model_search_dirs(const std::string& experiment_path);

// The first <dir>/<name>.yaml that exists.
std::optional<std::filesystem::path> find_model_file(const std::string& name,
                                                     const std::vector<std::filesystem::path>& dirs);

// Names (file stems) of the *.yaml files in the directories, sorted, without duplicates.
std::vector<std::string> available_models(const std::vector<std::filesystem::path>& dirs);

}  // namespace forge
