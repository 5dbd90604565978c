// Reports of `forge bench` runs for people and for programs: a markdown table laid out as
// the seeds' performance tables (Models | Precision | Batch Size | Sequence Length |
// TFLOPS/s/GPU, then forge's extra columns), and a JSON array with every field of every
// BenchResult. perf.csv, the third report, is in perf_csv.h.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_result.h"

namespace forge {

// Columns: Model, Precision (precision_label: "BF16", "FP8 (tensorwise)"), Batch Size
// (micro-batch per GPU), Sequence Length, TFLOP/s/GPU, Tokens/s/GPU, Step time (median,
// min-max), MFU (against the bf16 peak; an FP8 run adds "(FP8 peak x%)"), Peak memory (GiB),
// Status. A run that ran out of memory or failed shows "-" for every measured number and
// its status ("OOM", "failed: <why>").
std::string bench_markdown_table(const std::vector<BenchResult>& results);

// Every field under its C++ name; mfu (and mfu_fp8) is null when the device's peak is
// unknown (mfu_fp8 also when the run is not FP8), config is the resolved experiment config.
void to_json(nlohmann::json& out, const BenchResult& result);

// The results as a JSON array, written to a temporary file beside `path` and renamed over
// it, so a reader never sees half a report.
void write_bench_json(const std::string& path, const std::vector<BenchResult>& results);

}  // namespace forge
