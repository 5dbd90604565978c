// MLPerf Training's reference convergence points (RCPs) and the RCP check, computed as
// mlperf_logging.rcp_checker does it (PyPI mlperf-logging 4.1.68,
// mlperf_logging/rcp_checker/rcp_checker.py, with its default --rcp_pass pruned_rcps),
// for the benchmarks forge runs: llama31_8b, llama2_70b_lora and flux1.
//
// NOTE [RCP normalization]
// An RCP is a reference's samples-to-converge of 20 runs at one global batch size. Its
// mean is the olympic mean (fastest and slowest dropped), its stdev the population stdev
// of all 20 (numpy.std). The checker first prunes the RCPs (keeps those at or above the
// batch of fastest convergence, then drops each point that converges slower than the line
// between its neighbours), then takes the RCP at the submission's batch size, or
// interpolates linearly between the pruned neighbours, or, below the smallest RCP batch,
// compares against the smallest. A submission's samples-to-converge is the olympic mean of
// its runs' (a run that did not converge counts as 1e9 and is the one dropped; more than
// one such run fails the check). The check passes when that mean is at least the RCP's
// "min epochs": the smallest mean a one-sided t-test (alpha 0.05, equal variances,
// scipy.stats.ttest_ind_from_stats) cannot tell apart from the RCP mean, found by
// bisection to 1e-4. The normalization factor is RCP mean / submission mean, never below
// 1: a set that converges in fewer samples than the reference has its time-to-train
// scaled up by it (the result summarizer multiplies the olympic mean of the times by it).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace forge::mlperf {

struct RcpRecord {
  std::string name;                        // e.g. llama31_8b_ref_32
  int64_t batch = 0;                       // global batch size
  std::vector<double> samples_to_converge;  // the reference runs', as the JSON lists them
  double mean = 0, stdev = 0, min_mean = 0, max_speedup = 0;  // computed: NOTE [RCP normalization]
};

struct RcpBenchmark {
  std::string name;
  int submission_runs = 0;  // rcp_checker.submission_runs["training"][name]
  // The quality target: a run has converged once an eval_accuracy is at or below it
  // (compliance_checker/training_5.1.0/closed_<name>.yaml; llama31_8b: log perplexity,
  // llama2_70b_lora: evaluation loss).
  double target = 0;
  std::vector<RcpRecord> records;  // ascending batch size, statistics filled in
};

// The embedded tables (mlperf_rcp.cpp cites the files), statistics computed. Throws
// forge::Error naming the known benchmarks for any other name.
const RcpBenchmark& rcp_benchmark(const std::string& name);
std::vector<std::string> rcp_benchmark_names();

// The RCP checker's pruned set of records.
std::vector<RcpRecord> pruned_rcps(const RcpBenchmark& benchmark);

struct RcpCheck {
  bool passed = false;
  std::string message;          // rcp_checker's: "RCP found", "RCP Interpolation", ...
  bool have_record = false;     // an RCP (found or interpolated) was compared with
  RcpRecord record;             // that RCP
  double submission_mean = 0;   // olympic mean samples-to-converge of the runs
  double norm_factor = 1.0;     // NOTE [RCP normalization]
};

// `samples_to_converge`: one entry per run; a run that did not converge is 1e9 (as the
// checker counts it). `not_converged`: how many of them.
RcpCheck check_rcp(const RcpBenchmark& benchmark, int64_t batch, std::vector<double> samples_to_converge,
                   int not_converged);

// Student's t distribution's CDF (public for the tests).
double student_t_cdf(double t, double degrees_of_freedom);

}  // namespace forge::mlperf
