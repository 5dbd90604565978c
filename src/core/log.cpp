#include "core/log.h"

#include "core/progress.h"

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
  progress_line_hide();  // a progress bar on the terminal stays below the log (core/progress.h)
  std::fprintf(out, "%s%s\n", prefix, message.c_str());
  std::fflush(out);
  progress_line_restore();
}

}  // namespace forge
