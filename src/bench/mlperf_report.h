// The page `forge mlperf score DIR --html FILE` writes, built from bench/report_page.h's
// pieces (self-contained, no script, every text from the files escaped):
//
//   the summary the command prints (train/mlperf_score.h score_summary), or, for a set that
//     cannot be scored (fewer than 3 runs, two that did not converge, ...), why not
//   a table of the runs: file, seed, status, minutes, samples to converge, last
//     eval_accuracy, and the means over the run's tracked_stats lines of throughput
//     (samples/s), tokens_per_s_per_gpu and tflops_per_gpu ("-" where no line holds one)
//   one chart: every run's eval_accuracy by samples_count, the benchmark's target
//     (RcpBenchmark::target) as a dashed line
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "train/mlperf_score.h"

namespace forge {

struct MlperfReport {
  std::string dir;                      // the directory of result files
  std::vector<mlperf::ResultRun> runs;  // each file's, in name order
  std::optional<mlperf::Score> score;   // absent when the set cannot be scored
  std::string no_score;                 // then why (score_runs' message)
  std::string benchmark;                // names the target; empty when the logs do not agree on one
};

// `generated_at` is printed in the page's header (e.g. "2025-06-01 12:00 UTC").
std::string render_mlperf_report(const MlperfReport& report, const std::string& generated_at);

}  // namespace forge
