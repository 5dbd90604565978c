#include "train/run_dir.h"

#include <chrono>
#include <ctime>
#include <filesystem>

#include "core/error.h"

namespace forge {

std::string expand_run_dir(const std::string& pattern, const std::string& model_name) {
  std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", &utc);
  std::string out = pattern;
  auto replace_all = [&](const std::string& key, const std::string& value) {
    for (size_t pos; (pos = out.find(key)) != std::string::npos;) out.replace(pos, key.size(), value);
  };
  replace_all("{model}", model_name);
  replace_all("{time}", stamp);
  return out;
}

void create_run_dir(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) FORGE_FAIL("cannot create run directory '{}' (logging.run_dir): {}", path, ec.message());
}

}  // namespace forge
