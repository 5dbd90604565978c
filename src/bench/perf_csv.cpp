// Appending to perf.csv: read and check what is there, compute each new row's change
// against the history, write the old bytes plus the new rows atomically.
//
// NOTE [perf.csv columns]
// MAD's perf.csv has one row per measured run and metric. forge fills its columns so:
//   model               model.name ("llama3.1-8b")
//   n_gpus              GPUs the run used
//   training_precision  precision.compute_dtype ("bf16"), or "fp8 (tensorwise)" for a
//                       precision.fp8 run (its MFU is in the JSON report)
//   pipeline            the CI pipeline from $pipeline, as MAD reads it; empty outside CI
//   args                the command-line overrides that define the run, as given
//   tags                "forge", then the parallelism and activation checkpointing when
//                       known ("forge,fsdp 4,full"), comma-separated as MAD's tag lists
//   machine_name        the host name
//   gpu_architecture    "sm_90" (MAD writes "gfx942"); empty on the CPU
//   performance         model TFLOP/s per GPU, 2 decimals: the number of the seeds'
//                       tables ("TFLOPS/s/GPU"); empty when the run failed
//   metric              "TFLOPS_per_gpu", MAD's name for it in its PyTorch training
//                       reports (tokens/s/GPU and the rest are in the JSON report)
//   relative_change     percent change of performance against the latest earlier row
//                       with the same model, args, training_precision and metric that
//                       has a performance,
//                       2 decimals ("-3.25"); empty when there is none or this run failed
//   status              SUCCESS or FAILURE, as MAD writes it (an OOM is a FAILURE)
//   build_duration      empty: forge builds no container per run
//   test_duration       seconds the whole run took, set-up included
// MAD's own header has more columns (docker image, git commit, data provider, ...) that
// have no meaning for a native binary; forge keeps MAD's names and relative order for
// the ones it writes, and refuses to append to a file with any other header.
#include "bench/perf_csv.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bench/csv.h"
#include "core/durable_file.h"
#include "core/error.h"

namespace forge {
namespace {

constexpr const char* kMetric = "TFLOPS_per_gpu";

enum Column { kModel, kNGpus, kPrecision, kPipeline, kArgs, kTags, kMachine, kArch, kPerformance, kMetricColumn,
              kRelativeChange, kStatus, kBuildDuration, kTestDuration, kColumnCount };

std::optional<double> parse_performance(const std::string& text) {
  double value = 0;
  const char* end = text.data() + text.size();
  auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end) return std::nullopt;
  return value;
}

std::string read_existing(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return "";
  if (!std::filesystem::is_regular_file(path, ec)) FORGE_FAIL("{}: exists and is not a file; perf.csv not written", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) FORGE_FAIL("{}: cannot open to append perf.csv rows", path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The existing rows, after checking the header and every row's width; nullopt when the
// file has no header yet (absent, empty or blank).
std::optional<std::vector<std::vector<std::string>>> existing_rows(const std::string& text, const std::string& path) {
  std::vector<CsvRecord> records = parse_csv(text, path);
  if (records.empty()) return std::nullopt;
  const auto& expected = perf_csv_columns();
  const auto& header = records.front().fields;
  if (header != expected) {
    std::string difference;
    for (size_t i = 0; i < std::max(header.size(), expected.size()); ++i) {
      if (i >= header.size()) {
        difference = fmt::format("column {} '{}' is missing", i + 1, expected[i]);
      } else if (i >= expected.size()) {
        difference = fmt::format("column {} '{}' is not one of them", i + 1, header[i]);
      } else if (header[i] != expected[i]) {
        difference = fmt::format("column {} is '{}', expected '{}'", i + 1, header[i], expected[i]);
      } else {
        continue;
      }
      break;
    }
    FORGE_FAIL("{}:{}: not a forge perf.csv header ({}); expected the columns {}; nothing was written", path,
               records.front().line, difference, fmt::join(expected, ","));
  }
  std::vector<std::vector<std::string>> rows;
  for (size_t i = 1; i < records.size(); ++i) {
    if (records[i].fields.size() != expected.size()) {
      FORGE_FAIL("{}:{}: a row of {} fields, the header has {}; nothing was written", path, records[i].line,
                 records[i].fields.size(), expected.size());
    }
    rows.push_back(std::move(records[i].fields));
  }
  return rows;
}

std::string tags_for(const BenchResult& r) {
  std::vector<std::string> tags = {"forge"};
  for (const std::string& tag : {r.parallelism, r.activation_checkpoint}) {
    if (!tag.empty()) tags.push_back(tag);
  }
  return fmt::format("{}", fmt::join(tags, ","));
}

std::vector<std::string> row_for(const BenchResult& r, const PerfCsvContext& context,
                                 const std::vector<std::vector<std::string>>& earlier) {
  const bool success = r.status == "ok";
  std::vector<std::string> row(kColumnCount);
  row[kModel] = r.model;
  row[kNGpus] = std::to_string(r.n_gpus);
  std::string precision = precision_label(r);
  std::transform(precision.begin(), precision.end(), precision.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  row[kPrecision] = precision;
  row[kPipeline] = context.pipeline;
  row[kArgs] = r.args;
  row[kTags] = tags_for(r);
  row[kMachine] = context.machine_name;
  row[kArch] = r.gpu_architecture;
  row[kMetricColumn] = kMetric;
  row[kStatus] = success ? "SUCCESS" : "FAILURE";
  row[kTestDuration] = fmt::format("{:.1f}", r.duration_s);
  if (!success) return row;
  row[kPerformance] = fmt::format("{:.2f}", r.tflops_per_gpu);
  for (auto it = earlier.rbegin(); it != earlier.rend(); ++it) {
    const auto& previous = *it;
    if (previous[kModel] != r.model || previous[kArgs] != r.args || previous[kPrecision] != row[kPrecision] ||
        previous[kMetricColumn] != kMetric)
      continue;
    const std::optional<double> base = parse_performance(previous[kPerformance]);
    if (!base) continue;
    if (*base > 0) row[kRelativeChange] = fmt::format("{:.2f}", 100.0 * (r.tflops_per_gpu / *base - 1.0));
    break;
  }
  return row;
}

}  // namespace

const std::vector<std::string>& perf_csv_columns() {
  static const std::vector<std::string> columns = {
      "model", "n_gpus", "training_precision", "pipeline", "args", "tags", "machine_name",
      "gpu_architecture", "performance", "metric", "relative_change", "status", "build_duration", "test_duration"};
  return columns;
}

PerfCsvContext perf_csv_context_from_environment() {
  PerfCsvContext context;
  char host[HOST_NAME_MAX + 1] = {};
  if (::gethostname(host, sizeof(host) - 1) == 0) context.machine_name = host;
  if (const char* pipeline = std::getenv("pipeline")) context.pipeline = pipeline;
  return context;
}

void append_perf_csv(const std::string& path, const std::vector<BenchResult>& results,
                     const PerfCsvContext& context) {
  std::string text = read_existing(path);
  std::optional<std::vector<std::vector<std::string>>> existing = existing_rows(text, path);
  if (!existing) text = csv_line(perf_csv_columns());
  std::vector<std::vector<std::string>> rows = existing.value_or(std::vector<std::vector<std::string>>{});
  if (!text.empty() && text.back() != '\n' && text.back() != '\r') text += '\n';
  for (const BenchResult& result : results) {
    rows.push_back(row_for(result, context, rows));
    text += csv_line(rows.back());
  }
  write_file_atomic(path, text, {.sync = false});  // NOTE [Durable files]
}

}  // namespace forge
