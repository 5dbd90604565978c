#include "train/restart_log.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>

#include "core/error.h"
#include "core/log.h"

namespace forge {
namespace {

std::string env_or(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value && *value ? value : fallback;
}

}  // namespace

void record_restart(const std::string& run_dir, const std::optional<std::string>& resume_from) {
  const std::string count = env_or("FORGE_RESTART_COUNT", "0");
  if (count == "0") return;
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%dT%H:%M:%SZ", &utc);
  const std::string line =
      fmt::format("{} restart {} of {} after {}; {}", stamp, count, env_or("FORGE_MAX_RESTARTS", "?"),
                  env_or("FORGE_RESTART_REASON", "a failure"),
                  resume_from ? "resuming from " + *resume_from : std::string("no checkpoint: starting from step 0"));
  log_warn("{}", line);
  const std::string path = run_dir + "/restarts.log";
  std::ofstream out(path, std::ios::app);
  out << line << '\n';
  out.flush();
  if (!out) FORGE_FAIL("cannot append to {}: {}", path, std::strerror(errno));
}

}  // namespace forge
