// Scoring a set of MLPerf Training runs from their MLLOG result files, as the MLPerf
// tools do: time-to-train per run as mlperf_logging/result_summarizer/result_summarizer.py
// (run_stop - run_start, in minutes), samples to converge as rcp_checker.py (the last
// eval_accuracy's samples_count before a successful run_stop), the olympic mean of the
// times, and the RCP normalization of mlperf_rcp.h (NOTE [RCP normalization]).
//
// NOTE [Scoring non-converged runs]
// A run whose run_stop is missing or has a status other than "success" did not converge:
// the RCP checker counts it as 1e9 samples and the summarizer drops it as the slowest
// time, so it is the one run dropped from the top; more than one such run makes the set
// unscorable (rcp_checker: "Insufficient convergence"; summarizer: "Too many
// non-converging runs").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "train/mlperf_rcp.h"

namespace forge::mlperf {

// One eval_accuracy line: the evaluation after `samples` training samples.
struct EvalPoint {
  int64_t samples = 0;
  double value = 0;
};

// One tracked_stats line: the throughput of a block's training steps. forge's run mode
// logs all three members; other logs may hold only throughput, or members of their own
// (checked to be numbers, not kept).
struct TrackedStats {
  int64_t step = -1;                           // metadata.step (forge: the samples count), -1 when absent
  std::optional<double> throughput;            // samples per second
  std::optional<double> tokens_per_s_per_gpu;
  std::optional<double> tflops_per_gpu;
};

struct ResultRun {
  std::string file;
  std::string benchmark;       // submission_benchmark's value, empty when not logged
  int64_t global_batch = -1;   // global_batch_size's value, -1 when not logged
  std::optional<int64_t> seed;  // seed's value
  bool converged = false;      // run_stop with status success
  std::string why_not;         // when not converged: "no run_stop", "run_stop status aborted"
  double minutes = 0;          // run_stop - run_start (converged runs)
  int64_t samples = -1;        // samples to converge (converged runs that logged eval_accuracy)
  double last_eval = 0;        // the last eval_accuracy value before run_stop (NaN when none)
  std::vector<EvalPoint> evals;              // every eval_accuracy before run_stop, in file order
  std::vector<TrackedStats> tracked_stats;   // every tracked_stats before run_stop, in file order
};

// "converged", or "not converged: " and why.
std::string run_status(const ResultRun& run);

// Reads and validates one result file. A malformed `:::MLLOG` line, a missing or repeated
// run_start, an eval_accuracy without samples_count, a non-integer global_batch_size or
// seed, a tracked_stats value that is not an object of numbers: forge::Error naming
// FILE:LINE and what was expected.
ResultRun read_result_file(const std::string& path);

// DIR/result_*.txt, sorted by name; throws when there are none.
std::vector<std::string> result_files(const std::string& dir);

struct Score {
  std::string benchmark;
  int64_t global_batch = 0;
  std::vector<ResultRun> runs;
  int required_runs = 0;        // the rules' count for the benchmark
  int not_converged = 0;
  double mean_minutes = 0;      // olympic mean of the times (NOTE [Scoring non-converged runs])
  int averaged_runs = 0;        // how many times that mean averages
  RcpCheck rcp;
  double score_minutes = 0;     // mean_minutes * rcp.norm_factor
};

// The summary `forge mlperf score` prints and its HTML report shows, as (label, text):
// runs, mean time-to-train, samples to converge (when an RCP was compared with), RCP
// check, normalization factor, score.
std::vector<std::pair<std::string, std::string>> score_summary(const Score& score);
// The warning for fewer runs than the rules require (rcp_checker.submission_runs); empty
// for a complete set.
std::string incomplete_set_warning(const Score& score);

// The common submission_benchmark of `runs` (or `benchmark` when given); empty when none is
// logged or they differ.
std::string common_benchmark(const std::vector<ResultRun>& runs, const std::string& benchmark);

// `benchmark`: empty to take the logs' submission_benchmark; else the logs must agree with
// it (or not name one). Throws forge::Error for sets that cannot be scored: runs of mixed
// benchmarks or batch sizes, fewer than 3 runs, more than one non-converged run.
Score score_runs(std::vector<ResultRun> runs, const std::string& benchmark);

}  // namespace forge::mlperf
