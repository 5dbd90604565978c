// Console logging: info lines to stdout, warnings and errors to stderr, with the rank
// prefixed once distributed runs exist. Kept tiny: training prints few lines.
#pragma once

#include <fmt/format.h>

#include <string>

namespace forge {

enum class LogLevel { Debug, Info, Warn, Error };

void set_log_level(LogLevel level);
void log_message(LogLevel level, const std::string& message);

template <typename... Args> void log_info(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Info, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args> void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Warn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args> void log_error(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Error, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args> void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Debug, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace forge
