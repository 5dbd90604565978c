// perf.csv: the file ROCm MAD collects benchmark results in (~/MAD/perf.csv in the seeds),
// so forge's runs land in the same dashboards and scripts. One row per BenchResult,
// appended; see NOTE [perf.csv columns] in perf_csv.cpp for what each column holds.
#pragma once

#include <string>
#include <vector>

#include "bench/bench_result.h"

namespace forge {

// The columns, in order: model, n_gpus, training_precision, pipeline, args, tags,
// machine_name, gpu_architecture, performance, metric, relative_change, status,
// build_duration, test_duration.
const std::vector<std::string>& perf_csv_columns();

// Where the rows were measured, as MAD records it.
struct PerfCsvContext {
  std::string machine_name;  // the host name
  std::string pipeline;      // the CI pipeline, from $pipeline as MAD reads it; empty outside CI
};

PerfCsvContext perf_csv_context_from_environment();

// Appends one row per result to `path`, creating the file with the header when it is
// absent or empty. An existing file must be a valid CSV whose header is exactly
// perf_csv_columns() and whose rows have that many fields; otherwise forge::Error names
// the file (and line) and the file is left untouched. The new file is written whole
// under a temporary name and renamed into place.
void append_perf_csv(const std::string& path, const std::vector<BenchResult>& results,
                     const PerfCsvContext& context);

}  // namespace forge
