// Run directories: logging.run_dir may hold {model} and {time} placeholders, expanded at
// start ({time} as YYYYmmdd-HHMMSS, UTC). The directory is created if missing.
#pragma once

#include <string>

namespace forge {

std::string expand_run_dir(const std::string& pattern, const std::string& model_name);
void create_run_dir(const std::string& path);

}  // namespace forge
