#include "cli/prep_progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace forge {

namespace {

constexpr double kTerminalInterval = 0.1;
constexpr double kLogInterval = 10.0;
constexpr int kBarWidth = 30;

}  // namespace

std::string format_bytes(double bytes) {
  if (bytes >= 1e9) return fmt::format("{:.2f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  if (bytes >= 1e3) return fmt::format("{:.1f} kB", bytes / 1e3);
  return fmt::format("{:.0f} B", bytes);
}

std::string format_duration(double seconds) {
  const auto total = static_cast<int64_t>(std::max(0.0, std::round(seconds)));
  const int64_t hours = total / 3600, minutes = total / 60 % 60, secs = total % 60;
  if (hours > 0) return fmt::format("{}:{:02}:{:02}", hours, minutes, secs);
  return fmt::format("{}:{:02}", minutes, secs);
}

PrepProgressPrinter::PrepProgressPrinter(bool terminal)
    : terminal_(terminal), next_print_seconds_(terminal ? 0.0 : kLogInterval) {}

std::string PrepProgressPrinter::describe(const PrepProgress& p) const {
  const double seconds = std::max(p.seconds, 1e-9);
  const double fraction =
      p.input_bytes_total > 0 ? std::min(1.0, static_cast<double>(p.input_bytes_read) / p.input_bytes_total) : 1.0;
  const double bytes_per_second = static_cast<double>(p.input_bytes_read) / seconds;
  const std::string eta = bytes_per_second > 0 && fraction < 1.0
                              ? format_duration(static_cast<double>(p.input_bytes_total - p.input_bytes_read) /
                                                bytes_per_second)
                              : "0:00";
  return fmt::format("{:5.1f}% {} / {} | {} docs ({:.0f} docs/s) | {}/s | elapsed {} | ETA {}", 100.0 * fraction,
                     format_bytes(static_cast<double>(p.input_bytes_read)),
                     format_bytes(static_cast<double>(p.input_bytes_total)), p.documents, p.documents / seconds,
                     format_bytes(bytes_per_second), format_duration(p.seconds), eta);
}

void PrepProgressPrinter::update(const PrepProgress& p) {
  if (p.seconds < next_print_seconds_) return;
  next_print_seconds_ = p.seconds + (terminal_ ? kTerminalInterval : kLogInterval);
  if (!terminal_) {
    std::fprintf(stderr, "prep: %s\n", describe(p).c_str());
    std::fflush(stderr);
    return;
  }
  const double fraction =
      p.input_bytes_total > 0 ? std::min(1.0, static_cast<double>(p.input_bytes_read) / p.input_bytes_total) : 1.0;
  const int filled = static_cast<int>(fraction * kBarWidth);
  const std::string bar = std::string(static_cast<size_t>(filled), '#') +
                          std::string(static_cast<size_t>(kBarWidth - filled), '.');
  std::fprintf(stderr, "\r\033[K[%s] %s", bar.c_str(), describe(p).c_str());
  std::fflush(stderr);
  line_open_ = true;
}

void PrepProgressPrinter::finish() {
  if (!line_open_) return;
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  line_open_ = false;
}

}  // namespace forge
