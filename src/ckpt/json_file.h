// Reading the small JSON files of model directories (config.json, index files), with
// errors that name the file.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace forge {

// Parses the file; throws forge::Error naming it when it cannot be read or is not JSON.
nlohmann::json read_json_file(const std::string& path);

}  // namespace forge
