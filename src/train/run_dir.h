// Run directories: logging.run_dir may hold {model} and {time} placeholders, expanded at
// start ({time} as YYYYmmdd-HHMMSS, UTC). The directory is created if missing.
#pragma once

#include <string>

namespace forge {

std::string expand_run_dir(const std::string& pattern, const std::string& model_name);
void create_run_dir(const std::string& path);
// Writes a whole file atomically (temp file + rename), so a crash never leaves half of it.
void write_file_atomic(const std::string& path, const std::string& contents);

}  // namespace forge
