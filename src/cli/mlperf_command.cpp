// forge mlperf score DIR [--benchmark NAME]: reads and validates every DIR/result_*.txt
// (train/mlperf_score.h), then prints each run, the olympic mean time-to-train, the RCP
// check and normalization factor (NOTE [RCP normalization]) and the score.
#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "cli/commands.h"
#include "core/log.h"
#include "train/mlperf_score.h"

namespace forge {

int run_mlperf_score(const std::string& dir, const std::string& benchmark) {
  std::vector<mlperf::ResultRun> runs;
  for (const auto& file : mlperf::result_files(dir)) runs.push_back(mlperf::read_result_file(file));
  const mlperf::Score s = mlperf::score_runs(std::move(runs), benchmark);

  fmt::print("benchmark: {} at global batch {}, {} result files in {}\n", s.benchmark, s.global_batch, s.runs.size(),
             dir);
  fmt::print("{:<24} {:>12} {:>12} {:>12}  {}\n", "run", "minutes", "samples", "last eval", "status");
  for (const auto& r : s.runs) {
    const std::string name = std::filesystem::path(r.file).filename().string();
    const std::string eval = std::isnan(r.last_eval) ? "-" : fmt::format("{:.4f}", r.last_eval);
    if (r.converged)
      fmt::print("{:<24} {:>12.4f} {:>12} {:>12}  converged\n", name, r.minutes, r.samples, eval);
    else
      fmt::print("{:<24} {:>12} {:>12} {:>12}  not converged: {}\n", name, "-", "-", eval, r.why_not);
  }
  if (static_cast<int>(s.runs.size()) < s.required_runs)
    log_warn("{} runs: the rules require {} for {} (rcp_checker.submission_runs): not a complete submission set",
             s.runs.size(), s.required_runs, s.benchmark);
  fmt::print("runs: {} ({} converged; the olympic mean averages {})\n", s.runs.size(),
             s.runs.size() - static_cast<size_t>(s.not_converged), s.averaged_runs);
  fmt::print("mean time-to-train: {:.4f} minutes\n", s.mean_minutes);
  if (s.rcp.have_record)
    fmt::print("samples to converge: {:.1f} (olympic mean); RCP {}: mean {:.1f}, minimum acceptable {:.1f}\n",
               s.rcp.submission_mean, s.rcp.record.name, s.rcp.record.mean, s.rcp.record.mean / s.rcp.record.max_speedup);
  fmt::print("RCP check: {} ({})\n", s.rcp.passed ? "PASSED" : "FAILED", s.rcp.message);
  fmt::print("normalization factor: {:.6f}\n", s.rcp.norm_factor);
  fmt::print("score: {:.4f} minutes\n", s.score_minutes);
  std::fflush(stdout);
  return s.rcp.passed ? 0 : 1;
}

}  // namespace forge
