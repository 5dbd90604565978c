// forge mlperf score DIR [--benchmark NAME] [--html FILE]: reads and validates every
// DIR/result_*.txt (train/mlperf_score.h), then prints each run, the olympic mean
// time-to-train, the RCP check and normalization factor (NOTE [RCP normalization]) and the
// score; with --html also writes the report of bench/mlperf_report.h, atomically (an
// earlier report stays whole when the write fails), also when the RCP check fails or the
// set cannot be scored (the page then says why; the exit status is the same).
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "bench/mlperf_report.h"
#include "bench/report_page.h"
#include "cli/commands.h"
#include "core/durable_file.h"
#include "core/error.h"
#include "core/log.h"
#include "train/mlperf_score.h"

namespace forge {
namespace {

void print_summary(const mlperf::Score& s, const std::string& dir) {
  fmt::print("benchmark: {} at global batch {}, {} result files in {}\n", s.benchmark, s.global_batch, s.runs.size(),
             dir);
  fmt::print("{:<24} {:>12} {:>12} {:>12}  {}\n", "run", "minutes", "samples", "last eval", "status");
  for (const auto& r : s.runs) {
    const std::string name = std::filesystem::path(r.file).filename().string();
    const std::string eval = std::isnan(r.last_eval) ? "-" : fmt::format("{:.4f}", r.last_eval);
    if (r.converged)
      fmt::print("{:<24} {:>12.4f} {:>12} {:>12}  {}\n", name, r.minutes, r.samples, eval, mlperf::run_status(r));
    else
      fmt::print("{:<24} {:>12} {:>12} {:>12}  {}\n", name, "-", "-", eval, mlperf::run_status(r));
  }
  if (const std::string warning = mlperf::incomplete_set_warning(s); !warning.empty()) log_warn("{}", warning);
  for (const auto& [label, text] : mlperf::score_summary(s)) fmt::print("{}: {}\n", label, text);
  std::fflush(stdout);
}

void write_report(const std::string& path, const MlperfReport& report) {
  try {
    write_file_atomic(path, render_mlperf_report(report, utc_timestamp()), {.sync = false});  // NOTE [Durable files]
  } catch (const Error& e) {
    FORGE_FAIL("cannot write the HTML report '{}': {}", path, e.what());
  }
  log_info("report: {} result file{} -> {}", report.runs.size(), report.runs.size() == 1 ? "" : "s", path);
}

}  // namespace

int run_mlperf_score(const std::string& dir, const std::string& benchmark, const std::string& html) {
  std::error_code error;
  if (!html.empty() && std::filesystem::is_directory(html, error))
    FORGE_FAIL("--html '{}' is a directory: give the HTML file to write, such as {}/mlperf.html", html, html);
  std::vector<mlperf::ResultRun> runs;
  for (const auto& file : mlperf::result_files(dir)) runs.push_back(mlperf::read_result_file(file));
  MlperfReport report{dir, runs, std::nullopt, "", mlperf::common_benchmark(runs, benchmark)};
  try {
    report.score = mlperf::score_runs(std::move(runs), benchmark);
  } catch (const Error& e) {
    if (!html.empty()) {
      report.no_score = e.what();
      write_report(html, report);
    }
    throw;
  }
  print_summary(*report.score, dir);
  if (!html.empty()) write_report(html, report);
  return report.score->rcp.passed ? 0 : 1;
}

}  // namespace forge
