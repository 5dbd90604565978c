// Scoring MLPerf result files: mlperf_score.h.
#include "train/mlperf_score.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <sstream>

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_input.h"
#include "train/mllog.h"

namespace forge::mlperf {
namespace {

using mllog::Json;

// One `:::MLLOG` line's JSON, checked for the fields mllog.py writes
// (NOTE [MLLOG line format]).
// Parsed as every user JSON is (NOTE [Bounded JSON input] in core/json_input.h), and its
// values shown in messages through describe_json.
Json parse_line(const std::string& path, size_t lineno, const std::string& text) {
  const auto where = fmt::format("{}:{}", path, lineno);
  Json j;
  try {
    j = parse_json(text, "the MLLOG record");
  } catch (const Error& e) {
    FORGE_FAIL("{}: the text after ':::MLLOG ' is not valid JSON ({})", where, e.what());
  }
  if (!j.is_object()) FORGE_FAIL("{}: the text after ':::MLLOG ' must be a JSON object", where);
  for (const char* field : {"namespace", "time_ms", "event_type", "key", "value", "metadata"})
    if (!j.contains(field)) FORGE_FAIL("{}: the MLLOG record has no '{}'", where, field);
  if (!j["time_ms"].is_number() || !std::isfinite(j["time_ms"].get<double>()))
    FORGE_FAIL("{}: time_ms must be a number of milliseconds, got {}", where, describe_json(j["time_ms"]));
  if (!j["key"].is_string()) FORGE_FAIL("{}: key must be a string, got {}", where, describe_json(j["key"]));
  const auto& type = j["event_type"];
  if (!type.is_string() || (type != "POINT_IN_TIME" && type != "INTERVAL_START" && type != "INTERVAL_END"))
    FORGE_FAIL("{}: event_type must be POINT_IN_TIME, INTERVAL_START or INTERVAL_END, got {}", where, describe_json(type));
  if (!j["metadata"].is_object()) FORGE_FAIL("{}: metadata must be a JSON object, got {}", where, describe_json(j["metadata"]));
  return j;
}

// NOTE [Scoring non-converged runs]: the olympic mean of the converged times, the fastest
// dropped and the slowest too unless a non-converged run is the slowest.
double olympic_time_mean(std::vector<double> minutes, int not_converged, int& averaged) {
  std::sort(minutes.begin(), minutes.end());
  const size_t drop_top = not_converged == 0 ? 1 : 0;
  averaged = static_cast<int>(minutes.size()) - 1 - static_cast<int>(drop_top);
  return std::accumulate(minutes.begin() + 1, minutes.end() - static_cast<std::ptrdiff_t>(drop_top), 0.0) / averaged;
}

// A tracked_stats line: its value an object of numbers, metadata.step a count when present.
TrackedStats parse_tracked_stats(const std::string& where, const Json& value, const Json& metadata) {
  if (!value.is_object())
    FORGE_FAIL("{}: tracked_stats' value must be a JSON object of numbers (throughput, tokens_per_s_per_gpu, "
               "tflops_per_gpu), got {}",
               where, describe_json(value));
  TrackedStats stats;
  for (const auto& [name, member] : value.items()) {
    if (!member.is_number())
      FORGE_FAIL("{}: tracked_stats' {} must be a number, got {}", where, name, describe_json(member));
    const double v = member.get<double>();
    if (name == "throughput") stats.throughput = v;
    else if (name == "tokens_per_s_per_gpu") stats.tokens_per_s_per_gpu = v;
    else if (name == "tflops_per_gpu") stats.tflops_per_gpu = v;
  }
  if (metadata.contains(mllog::kStep)) {
    const Json& step = metadata[mllog::kStep];
    if (!step.is_number_integer() || step.get<int64_t>() < 0)
      FORGE_FAIL("{}: tracked_stats' metadata.step must be a non-negative integer, got {}", where, describe_json(step));
    stats.step = step;
  }
  return stats;
}

}  // namespace

std::string run_status(const ResultRun& run) { return run.converged ? "converged" : "not converged: " + run.why_not; }

ResultRun read_result_file(const std::string& path) {
  const std::string text = read_regular_file(path, "MLPerf result file");
  ResultRun run;
  run.file = path;
  run.last_eval = std::nan("");
  std::istringstream in(text);
  std::string line;
  size_t lineno = 0;
  bool have_start = false, have_stop = false;
  double start_ms = 0;
  int64_t last_samples = -1;
  while (std::getline(in, line)) {
    ++lineno;
    const size_t at = line.find(mllog::kLineToken);  // anywhere in the line, as the checkers
    if (at == std::string::npos) continue;
    const Json j = parse_line(path, lineno, line.substr(at + std::string(mllog::kLineToken).size()));
    const std::string key = j["key"];
    const auto where = fmt::format("{}:{}", path, lineno);
    const Json& value = j["value"];
    const Json& metadata = j["metadata"];
    const double time_ms = j["time_ms"].get<double>();
    if (key == mllog::kSubmissionBenchmark) {
      if (!value.is_string()) FORGE_FAIL("{}: submission_benchmark must be a string, got {}", where, describe_json(value));
      if (!run.benchmark.empty() && run.benchmark != value.get<std::string>())
        FORGE_FAIL("{}: a second submission_benchmark, {}, after '{}'", where, describe_json(value), run.benchmark);
      run.benchmark = value;
    } else if (key == mllog::kGlobalBatchSize) {
      if (!value.is_number_integer() || value.get<int64_t>() <= 0)
        FORGE_FAIL("{}: global_batch_size must be a positive integer, got {}", where, describe_json(value));
      run.global_batch = value;
    } else if (key == mllog::kSeed) {
      if (!value.is_number_integer() || (value.is_number_unsigned() && value.get<uint64_t>() > INT64_MAX))
        FORGE_FAIL("{}: seed must be an integer (64-bit), got {}", where, describe_json(value));
      run.seed = value.get<int64_t>();
    } else if (key == mllog::kTrackedStats && !have_stop) {
      run.tracked_stats.push_back(parse_tracked_stats(where, value, metadata));
    } else if (key == mllog::kRunStart) {
      if (have_start) FORGE_FAIL("{}: a second run_start (the rules allow exactly one per result file)", where);
      have_start = true;
      start_ms = time_ms;
    } else if (key == mllog::kEvalAccuracy && !have_stop) {
      if (!metadata.contains(mllog::kSamplesCount) || !metadata[mllog::kSamplesCount].is_number_integer())
        FORGE_FAIL("{}: eval_accuracy needs an integer metadata.samples_count (the 5.1 rules of llama31_8b, "
                   "llama2_70b_lora and flux1), got metadata {}",
                   where, describe_json(metadata));
      if (!value.is_number()) FORGE_FAIL("{}: eval_accuracy's value must be a number, got {}", where, describe_json(value));
      last_samples = metadata[mllog::kSamplesCount];
      run.last_eval = value.get<double>();
      run.evals.push_back({last_samples, run.last_eval});
    } else if (key == mllog::kRunStop) {
      if (!have_start) FORGE_FAIL("{}: run_stop before any run_start", where);
      if (have_stop) FORGE_FAIL("{}: a second run_stop (the rules allow exactly one per result file)", where);
      have_stop = true;
      if (!metadata.contains(mllog::kStatus) || !metadata[mllog::kStatus].is_string())
        FORGE_FAIL("{}: run_stop needs metadata.status (success or aborted), got metadata {}", where, describe_json(metadata));
      const std::string status = metadata[mllog::kStatus];
      if (status == mllog::kSuccess) {
        run.converged = true;
        run.minutes = (time_ms - start_ms) / 60.0 / 1000.0;
        run.samples = last_samples;
        if (run.minutes < 0) FORGE_FAIL("{}: run_stop is {} ms before run_start", where, start_ms - time_ms);
      } else {
        run.why_not = "run_stop status " + status;
      }
    }
  }
  if (!have_start) FORGE_FAIL("{}: no run_start line: not an MLPerf result file", path);
  if (!have_stop) run.why_not = "no run_stop (the run did not finish)";
  if (run.converged && run.samples < 0)
    FORGE_FAIL("{}: run_stop success but no eval_accuracy before it: the samples to converge are unknown", path);
  return run;
}

std::vector<std::string> result_files(const std::string& dir) {
  std::error_code error;
  if (!std::filesystem::is_directory(dir, error)) FORGE_FAIL("'{}' is not a directory of result_*.txt files", dir);
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("result_") && name.ends_with(".txt")) files.push_back(entry.path().string());
  }
  if (files.empty()) FORGE_FAIL("'{}' holds no result_*.txt files", dir);
  std::sort(files.begin(), files.end());
  return files;
}

std::string common_benchmark(const std::vector<ResultRun>& runs, const std::string& benchmark) {
  std::string common = benchmark;
  for (const auto& r : runs) {
    if (r.benchmark.empty()) continue;
    if (common.empty()) common = r.benchmark;
    if (r.benchmark != common) return "";
  }
  return common;
}

std::vector<std::pair<std::string, std::string>> score_summary(const Score& s) {
  std::vector<std::pair<std::string, std::string>> lines;
  lines.emplace_back("runs", fmt::format("{} ({} converged; the olympic mean averages {})", s.runs.size(),
                                         s.runs.size() - static_cast<size_t>(s.not_converged), s.averaged_runs));
  lines.emplace_back("mean time-to-train", fmt::format("{:.4f} minutes", s.mean_minutes));
  if (s.rcp.have_record)
    lines.emplace_back("samples to converge",
                       fmt::format("{:.1f} (olympic mean); RCP {}: mean {:.1f}, minimum acceptable {:.1f}",
                                   s.rcp.submission_mean, s.rcp.record.name, s.rcp.record.mean,
                                   s.rcp.record.mean / s.rcp.record.max_speedup));
  lines.emplace_back("RCP check", fmt::format("{} ({})", s.rcp.passed ? "PASSED" : "FAILED", s.rcp.message));
  lines.emplace_back("normalization factor", fmt::format("{:.6f}", s.rcp.norm_factor));
  lines.emplace_back("score", fmt::format("{:.4f} minutes", s.score_minutes));
  return lines;
}

std::string incomplete_set_warning(const Score& s) {
  if (static_cast<int>(s.runs.size()) >= s.required_runs) return "";
  return fmt::format("{} runs: the rules require {} for {} (rcp_checker.submission_runs): not a complete submission set",
                     s.runs.size(), s.required_runs, s.benchmark);
}

Score score_runs(std::vector<ResultRun> runs, const std::string& benchmark) {
  Score s;
  s.benchmark = benchmark;
  for (const auto& r : runs) {
    if (r.benchmark.empty()) continue;
    if (s.benchmark.empty()) s.benchmark = r.benchmark;
    if (r.benchmark != s.benchmark)
      FORGE_FAIL("{}: submission_benchmark '{}', but {} '{}': score one benchmark's runs at a time", r.file,
                 r.benchmark, benchmark.empty() ? "the other files log" : "--benchmark is", s.benchmark);
  }
  if (s.benchmark.empty())
    FORGE_FAIL("no result file logs submission_benchmark: name the benchmark with --benchmark");
  const RcpBenchmark& table = rcp_benchmark(s.benchmark);
  s.required_runs = table.submission_runs;
  s.global_batch = -1;
  for (const auto& r : runs) {
    if (r.global_batch < 0) FORGE_FAIL("{}: no global_batch_size line (the RCP check needs it)", r.file);
    if (s.global_batch >= 0 && r.global_batch != s.global_batch)
      FORGE_FAIL("{}: global_batch_size {}, but {} logs {}: one set has one batch size", r.file, r.global_batch,
                 runs.front().file, s.global_batch);
    s.global_batch = r.global_batch;
  }
  if (runs.size() < 3)
    FORGE_FAIL("{} run{}: the olympic mean drops the fastest and the slowest and needs at least 3 ({} for a "
               "submission of {})",
               runs.size(), runs.size() == 1 ? "" : "s", s.required_runs, s.benchmark);
  std::vector<double> minutes, samples;
  for (const auto& r : runs) {
    if (r.converged) {
      minutes.push_back(r.minutes);
      samples.push_back(static_cast<double>(r.samples));
    } else {
      ++s.not_converged;
      samples.push_back(1e9);  // as rcp_checker.read_submission_file
    }
  }
  if (s.not_converged > 1)
    FORGE_FAIL("{} of {} runs did not converge: at most one may (the dropped slowest run)", s.not_converged,
               runs.size());
  s.mean_minutes = olympic_time_mean(minutes, s.not_converged, s.averaged_runs);
  s.rcp = check_rcp(table, s.global_batch, samples, s.not_converged);
  s.score_minutes = s.mean_minutes * s.rcp.norm_factor;
  s.runs = std::move(runs);
  return s;
}

}  // namespace forge::mlperf
