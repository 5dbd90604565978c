#include "train/run_dir.h"

#include <chrono>
#include <ctime>
#include <filesystem>
#include <string_view>

#include "core/error.h"

namespace forge {

std::string expand_run_dir(const std::string& pattern, const std::string& model_name) {
  std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &utc);
  // One pass over the pattern: a value is copied, never searched again, so a model named
  // "{model}" or "x-{time}" expands once (searching the growing result looped forever).
  std::string out;
  for (size_t pos = 0; pos < pattern.size();) {
    const std::string_view rest = std::string_view(pattern).substr(pos);
    if (rest.starts_with("{model}")) {
      out += model_name;
      pos += 7;
    } else if (rest.starts_with("{time}")) {
      out += stamp;
      pos += 6;
    } else {
      out += pattern[pos++];
    }
  }
  return out;
}

void create_run_dir(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) FORGE_FAIL("cannot create run directory '{}' (logging.run_dir): {}", path, ec.message());
}

}  // namespace forge
