// What `forge report` shows of a directory, read from the files forge leaves there:
//
//   metrics.jsonl  a training run: the run record (model, parameters, device) and every
//                  train and eval record (train/metrics.h writes them)
//   config.yaml    beside it, the resolved experiment: batch, sequence length, precision
//   bench.json     benchmark results, a JSON array of BenchResult objects (bench_result.h)
//
// A run directory holds metrics.jsonl (and bench.json when one was put there); the output
// directory of `forge bench` holds bench.json and one run directory per benchmarked run.
// Everything is checked while it is read: a missing directory, one with neither file, a
// line that is not a JSON object or lacks a field (named as file:line), or a bench.json
// entry of the wrong shape stops the report with an error before anything is written.
//
// NOTE [Report of a resumed run]
// A run resumed from its checkpoint at step k appends to metrics.jsonl after a
// {"type": "resume", "step": k} record, and trains k+1.. again; the records the
// interrupted run wrote past step k are dropped, so each step appears once, as the
// resumed run measured it (TensorBoard does the same: NOTE [TensorBoard resume]).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_result.h"
#include "train/metrics.h"

namespace forge {

struct ReportRun {
  std::string dir;             // as given on the command line
  std::string name;            // how the report labels it (set by the caller)
  bool has_metrics = false;    // a training run (metrics.jsonl), not only bench.json
  // From metrics.jsonl's run record (the last one, for a resumed run).
  std::string model;
  std::string device;
  int64_t parameters = 0;
  // From config.yaml, when the directory has one.
  std::optional<int64_t> micro_batch, grad_accum, global_batch, seq_len;
  std::string precision;  // precision.compute_dtype, or "FP8 (<recipe>)" with precision.fp8
  std::vector<StepMetrics> steps;  // in step order
  std::vector<EvalMetrics> evals;  // in step order
  std::vector<BenchResult> bench;  // bench.json, when present
};

// Reads one directory; fails as the header says.
ReportRun load_report_run(const std::string& dir);

// Reads a bench.json file: a JSON array of objects with BenchResult's fields. `model` and
// `status` are required; other fields may be absent (shown as n/a).
std::vector<BenchResult> load_bench_results(const std::string& path);

}  // namespace forge
