// Progress of a long task on stderr, for any command that has one (`forge prep` now; the
// trainer and the bench sweep next). The caller says what the whole is (start), how much
// is done with a line of its own figures (update), and when it ends (finish); the
// reporter adds the percentage, the elapsed time and the estimated time left.
//
// On a terminal, one line is redrawn in place at most ten times a second, led by a bar:
//   [#########.....................]  31.0% <extra text> | elapsed 0:42 | ETA 1:33
// Elsewhere (a log file, a CI job) a plain line is printed every 10 seconds instead, so
// logs stay readable:
//   prep:  31.0% <extra text> | elapsed 0:42 | ETA 1:33
// A log line printed while a bar is drawn goes above it: log_message() erases the bar,
// prints, and draws the bar again (progress_line_hide / progress_line_restore), so a
// sweep's bar stays at the bottom while its runs log.
#pragma once

#include <cstdio>
#include <functional>
#include <string>

namespace forge {

class ProgressReporter {
 public:
  using Clock = std::function<double()>;  // seconds, monotonic

  // `terminal`: `out` is a terminal (isatty), so the line can be redrawn in place. The
  // clock is injectable for tests; by default it is std::chrono::steady_clock.
  explicit ProgressReporter(bool terminal, std::FILE* out = stderr, Clock clock = {});
  ~ProgressReporter();

  // Begins a task of `total` units (bytes, steps, runs). A total of 0 counts as done.
  void start(double total, std::string label);
  // `done` units so far; `extra_text` is the caller's own figures for this moment. Prints
  // only when the interval since the last line has passed.
  void update(double done, const std::string& extra_text);
  // Ends the in-place line, if one was drawn. Safe to call more than once.
  void finish();
  // Erases the in-place line, if one was drawn, so that another line can be printed in
  // its place; the next update() draws it again.
  void clear();

 private:
  bool terminal_;
  std::FILE* out_;
  Clock clock_;
  double total_ = 0;
  std::string label_;
  double start_seconds_ = 0;
  double next_print_seconds_ = 0;
  bool line_open_ = false;
  std::string last_line_;  // what the terminal line shows, to draw again after a log line
  friend void progress_line_hide();
  friend void progress_line_restore();
};

// For the logger: erase the progress line drawn on a terminal, if any, before a log line;
// draw it again after.
void progress_line_hide();
void progress_line_restore();

// The text of one progress line after the bar or label: percentage, the extra text,
// elapsed time and ETA (from the average rate so far; 0:00 while no rate is known).
std::string format_progress(double done, double total, double elapsed_seconds, const std::string& extra_text);
// "[######........................]": `fraction` of `width` characters filled.
std::string format_progress_bar(double fraction, int width);
// "12.3 MB", "1.20 GB": decimal units, as throughput is quoted.
std::string format_bytes(double bytes);
// "1:02:03" or "2:03".
std::string format_duration(double seconds);

}  // namespace forge
