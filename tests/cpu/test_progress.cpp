// core/progress.h: the text of a progress line, and when the reporter prints one, with a
// fake clock so the 10-second cadence of log output is tested without waiting.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "core/progress.h"

namespace forge {
namespace {

// Everything written to a temporary FILE*.
std::string contents(std::FILE* f) {
  std::fflush(f);
  std::rewind(f);
  std::string out;
  for (int c; (c = std::fgetc(f)) != EOF;) out += static_cast<char>(c);
  return out;
}

TEST(Progress, FormatsPercentExtraElapsedAndEta) {
  // A quarter done after 30 s: 90 s left at the same rate.
  EXPECT_EQ(format_progress(25, 100, 30, "25 docs"), " 25.0% 25 docs | elapsed 0:30 | ETA 1:30");
  EXPECT_EQ(format_progress(25, 100, 30, ""), " 25.0% | elapsed 0:30 | ETA 1:30");
  EXPECT_EQ(format_progress(100, 100, 3725, "x"), "100.0% x | elapsed 1:02:05 | ETA 0:00");
  // Nothing done yet: no rate, no estimate. A total of 0 counts as done.
  EXPECT_EQ(format_progress(0, 100, 5, "x"), "  0.0% x | elapsed 0:05 | ETA 0:00");
  EXPECT_EQ(format_progress(0, 0, 1, "x"), "100.0% x | elapsed 0:01 | ETA 0:00");
}

TEST(Progress, FormatsBarsBytesAndDurations) {
  EXPECT_EQ(format_progress_bar(0.5, 10), "[#####.....]");
  EXPECT_EQ(format_progress_bar(0.0, 4), "[....]");
  EXPECT_EQ(format_progress_bar(1.5, 4), "[####]");
  EXPECT_EQ(format_bytes(999), "999 B");
  EXPECT_EQ(format_bytes(12'345), "12.3 kB");
  EXPECT_EQ(format_bytes(12'345'678), "12.3 MB");
  EXPECT_EQ(format_bytes(1'200'000'000), "1.20 GB");
  EXPECT_EQ(format_duration(59.4), "0:59");
  EXPECT_EQ(format_duration(61), "1:01");
  EXPECT_EQ(format_duration(3600), "1:00:00");
}

TEST(Progress, LogOutputIsALabelledLineEveryTenSeconds) {
  std::FILE* out = std::tmpfile();
  double now = 100;
  {
    ProgressReporter progress(false, out, [&] { return now; });
    progress.start(200, "bench");
    now = 105;
    progress.update(10, "first");  // before 10 s: nothing
    now = 110;
    progress.update(20, "second");
    now = 115;
    progress.update(30, "third");  // within 10 s of the last line: nothing
    now = 120.4;
    progress.update(40, "fourth");
    progress.finish();  // no in-place line to end
  }
  EXPECT_EQ(contents(out),
            "bench:  10.0% second | elapsed 0:10 | ETA 1:30\n"
            "bench:  20.0% fourth | elapsed 0:20 | ETA 1:22\n");
  std::fclose(out);
}

TEST(Progress, TerminalOutputRedrawsOneLineAndEndsIt) {
  std::FILE* out = std::tmpfile();
  double now = 0;
  ProgressReporter progress(true, out, [&] { return now; });
  progress.start(4, "train");
  progress.update(0, "a");
  now = 0.05;
  progress.update(1, "b");  // within 0.1 s: nothing
  now = 2;
  progress.update(2, "c");
  progress.finish();
  progress.finish();
  const std::string bar0 = "[" + std::string(30, '.') + "]";
  const std::string bar2 = "[" + std::string(15, '#') + std::string(15, '.') + "]";
  EXPECT_EQ(contents(out), "\r\033[K" + bar0 + "   0.0% a | elapsed 0:00 | ETA 0:00" + "\r\033[K" + bar2 +
                               "  50.0% c | elapsed 0:02 | ETA 0:02\n");
  std::fclose(out);
}

TEST(Progress, ALogLineGoesAboveTheBar) {
  std::FILE* f = std::tmpfile();
  double now = 0;
  {
    ProgressReporter p(true, f, [&] { return now; });
    p.start(4, "bench");
    now = 1;
    p.update(1, "1 of 4 runs");
    const std::string drawn = contents(f);
    progress_line_hide();
    std::fprintf(f, "a log line\n");
    progress_line_restore();
    progress_line_restore();  // once only
    const std::string bar = drawn.substr(4);  // after "\r\033[K"
    EXPECT_EQ(contents(f), drawn + "\r\033[Ka log line\n" + bar);
    p.finish();
    progress_line_hide();  // nothing drawn any more: nothing to erase
    EXPECT_EQ(contents(f), drawn + "\r\033[Ka log line\n" + bar + "\n");
  }
  progress_line_hide();  // the reporter is gone
  progress_line_restore();
  std::fclose(f);
}

}  // namespace
}  // namespace forge
