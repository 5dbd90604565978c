#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace forge {
namespace {
LogLevel g_level = LogLevel::Info;
std::mutex g_mu;
}  // namespace

void set_log_level(LogLevel level) { g_level = level; }

void log_message(LogLevel level, const std::string& message) {
  if (level < g_level) return;
  std::lock_guard lock(g_mu);
  FILE* out = level >= LogLevel::Warn ? stderr : stdout;
  const char* prefix = level == LogLevel::Warn ? "warning: " : level == LogLevel::Error ? "error: " : "";
  std::fprintf(out, "%s%s\n", prefix, message.c_str());
  std::fflush(out);
}

}  // namespace forge
