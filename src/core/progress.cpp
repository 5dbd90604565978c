#include "core/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>

namespace forge {

namespace {

constexpr double kTerminalInterval = 0.1;
constexpr double kLogInterval = 10.0;
constexpr int kBarWidth = 30;

double steady_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double fraction_done(double done, double total) { return total > 0 ? std::min(1.0, done / total) : 1.0; }

// The reporter whose line is on the terminal now (one at a time), and whether a log line
// has erased it.
ProgressReporter* g_line_owner = nullptr;
bool g_line_hidden = false;

}  // namespace

void progress_line_hide() {
  if (!g_line_owner || !g_line_owner->line_open_ || g_line_hidden) return;
  std::fprintf(g_line_owner->out_, "\r\033[K");
  std::fflush(g_line_owner->out_);
  g_line_hidden = true;
}

void progress_line_restore() {
  if (!g_line_owner || !g_line_hidden) return;
  g_line_hidden = false;
  if (!g_line_owner->line_open_) return;
  std::fprintf(g_line_owner->out_, "%s", g_line_owner->last_line_.c_str());
  std::fflush(g_line_owner->out_);
}

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

std::string format_progress_bar(double fraction, int width) {
  const int filled = std::clamp(static_cast<int>(fraction * width), 0, width);
  std::string bar(static_cast<size_t>(width) + 2, '.');
  bar.front() = '[';
  bar.back() = ']';
  std::fill_n(bar.begin() + 1, filled, '#');
  return bar;
}

std::string format_progress(double done, double total, double elapsed_seconds, const std::string& extra_text) {
  const double fraction = fraction_done(done, total);
  const double rate = done / std::max(elapsed_seconds, 1e-9);
  const std::string eta = rate > 0 && fraction < 1.0 ? format_duration((total - done) / rate) : "0:00";
  return fmt::format("{:5.1f}%{}{} | elapsed {} | ETA {}", 100.0 * fraction, extra_text.empty() ? "" : " ",
                     extra_text, format_duration(elapsed_seconds), eta);
}

ProgressReporter::ProgressReporter(bool terminal, std::FILE* out, Clock clock)
    : terminal_(terminal), out_(out), clock_(clock ? std::move(clock) : Clock(steady_seconds)) {}

ProgressReporter::~ProgressReporter() {
  finish();
  if (g_line_owner == this) g_line_owner = nullptr;
}

void ProgressReporter::start(double total, std::string label) {
  finish();
  total_ = total;
  label_ = std::move(label);
  start_seconds_ = clock_();
  next_print_seconds_ = terminal_ ? 0.0 : kLogInterval;
}

void ProgressReporter::update(double done, const std::string& extra_text) {
  const double elapsed = clock_() - start_seconds_;
  if (elapsed < next_print_seconds_) return;
  next_print_seconds_ = elapsed + (terminal_ ? kTerminalInterval : kLogInterval);
  const std::string text = format_progress(done, total_, elapsed, extra_text);
  if (terminal_) {
    last_line_ = format_progress_bar(fraction_done(done, total_), kBarWidth) + " " + text;
    std::fprintf(out_, "\r\033[K%s", last_line_.c_str());
    line_open_ = true;
    g_line_owner = this;
    g_line_hidden = false;
  } else {
    std::fprintf(out_, "%s: %s\n", label_.c_str(), text.c_str());
  }
  std::fflush(out_);
}

void ProgressReporter::clear() {
  if (g_line_owner == this) g_line_hidden = false;
  if (!line_open_) return;
  std::fprintf(out_, "\r\033[K");
  std::fflush(out_);
  line_open_ = false;
}

void ProgressReporter::finish() {
  if (g_line_owner == this) g_line_hidden = false;
  if (!line_open_) return;
  std::fprintf(out_, "\n");
  std::fflush(out_);
  line_open_ = false;
}

}  // namespace forge
