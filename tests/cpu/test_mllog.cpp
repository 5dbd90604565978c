// MLLOG lines (train/mllog.h) and result-file scoring (train/mlperf_score.h,
// train/mlperf_rcp.h). The comparison with the mlperf-logging package itself is
// tests/python/test_mlperf_logging.py; these pin the pieces: Python's float spelling, the
// line layout, appending, validation errors, the t distribution, the olympic mean.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "expect_error.h"
#include "file_testing.h"
#include "test_data_temp_dir.h"
#include "train/mllog.h"
#include "train/mlperf_rcp.h"
#include "train/mlperf_score.h"

namespace forge {
namespace {

using mllog::Json;

TEST(Mllog, FloatsAreSpelledAsPythonsJsonDumps) {
  // Expected strings from CPython 3.11's json.dumps.
  const std::vector<std::pair<double, std::string>> cases = {
      {0.0008, "0.0008"}, {1e-05, "1e-05"}, {1.0, "1.0"}, {0.925, "0.925"}, {1e16, "1e+16"},
      {1e15, "1000000000000000.0"}, {123456.789, "123456.789"}, {3.3, "3.3"}, {0.0001, "0.0001"},
      {5e-324, "5e-324"}, {-2.5e-7, "-2.5e-07"}, {0.0, "0.0"}, {1.5e300, "1.5e+300"}, {1200000.0, "1200000.0"}};
  for (const auto& [x, expected] : cases) EXPECT_EQ(mllog::dump_like_python(Json(x)), expected) << x;
  EXPECT_EQ(mllog::dump_like_python(Json(std::numeric_limits<double>::quiet_NaN())), "NaN");
  EXPECT_EQ(mllog::dump_like_python(Json(-std::numeric_limits<double>::infinity())), "-Infinity");
  EXPECT_EQ(mllog::dump_like_python(Json("caf\xc3\xa9 \"q\"")), "\"caf\\u00e9 \\\"q\\\"\"");
  EXPECT_EQ(mllog::dump_like_python(Json::parse(R"({"b": [1, 2.5, null, true], "a": {"x": "y"}})")),
            R"({"b": [1, 2.5, null, true], "a": {"x": "y"}})");
}

TEST(Mllog, LineHasTheFieldsInMllogsOrder) {
  Json metadata = Json::object();
  metadata["file"] = "src/train/x.cpp";
  metadata["lineno"] = 7;
  metadata["samples_count"] = 384;
  EXPECT_EQ(mllog::encode_line("", 1732000000123, mllog::EventType::kPoint, "eval_accuracy", 0.93, metadata),
            ":::MLLOG {\"namespace\": \"\", \"time_ms\": 1732000000123, \"event_type\": \"POINT_IN_TIME\", \"key\": "
            "\"eval_accuracy\", \"value\": 0.93, \"metadata\": {\"file\": \"src/train/x.cpp\", \"lineno\": 7, "
            "\"samples_count\": 384}}");
  EXPECT_EQ(mllog::source_file_name("/work/forge/src/train/trainer.cpp"), "src/train/trainer.cpp");
  EXPECT_EQ(mllog::source_file_name("../tests/tools/t.cpp"), "tests/tools/t.cpp");
  EXPECT_EQ(mllog::source_file_name("../x.cpp"), "x.cpp");
}

TEST(Mllog, WriterAppendsOneLinePerEvent) {
  TempDir dir;
  const std::string path = dir.file("result_0.txt");
  testing::write_file(path, "earlier run\n");
  int64_t now = 1000;
  {
    mllog::Writer log(path, false, "", [&] { return now; });
    log.start(mllog::kRunStart);
    now = 61000;
    log.end(mllog::kRunStop, nullptr, {{mllog::kSamplesCount, 3072}, {mllog::kStatus, mllog::kSuccess}});
    log.event(mllog::kLoraRank, 16);
    EXPECT_EQ(log.path(), path);
  }
  std::istringstream in(testing::read_file(path));
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "earlier run");
  const Json start = Json::parse(lines[1].substr(9));
  EXPECT_EQ(start["event_type"], "INTERVAL_START");
  EXPECT_EQ(start["time_ms"], 1000);
  EXPECT_EQ(start["metadata"]["file"], "tests/cpu/test_mllog.cpp");
  const Json stop = Json::parse(lines[2].substr(9));
  EXPECT_EQ(stop["event_type"], "INTERVAL_END");
  EXPECT_EQ(stop["metadata"]["status"], "success");
  EXPECT_EQ(lines[3].find(":::MLLOG {\"namespace\": \"\", \"time_ms\": 61000, \"event_type\": \"POINT_IN_TIME\", "
                          "\"key\": \"lora_rank\", \"value\": 16, \"metadata\": {\"file\": \"tests/cpu/test_mllog.cpp\""),
            0u)
      << lines[3];
}

TEST(Mllog, WriterErrorsNameTheFile) {
  TempDir dir;
  expect_error([&] { mllog::Writer log(dir.file("missing/result_0.txt"), false); },
               {"missing/result_0.txt", "cannot open"});
  mllog::Writer log(dir.file("result_0.txt"), false);
  expect_error([&] { log.event(mllog::kSeed, 1, Json::array({1})); }, {"metadata of 'seed' must be a JSON object"});
}

std::string line(const std::string& key, const std::string& value, const std::string& metadata, int64_t ms = 0) {
  return fmt::format(":::MLLOG {{\"namespace\": \"\", \"time_ms\": {}, \"event_type\": \"POINT_IN_TIME\", \"key\": "
                     "\"{}\", \"value\": {}, \"metadata\": {}}}\n",
                     ms, key, value, metadata);
}

TEST(MlperfScore, ReadsARunAndIgnoresOtherLines) {
  TempDir dir;
  const std::string path = dir.file("result_0.txt");
  testing::write_file(path, "plain text\n" + line("submission_benchmark", "\"llama2_70b_lora\"", "{}") +
                                line("global_batch_size", "8", "{}") + line("run_start", "null", "{}", 1000) +
                                "[rank 0] " + line("eval_accuracy", "0.95", R"({"samples_count": 384})") +
                                line("eval_accuracy", "0.92", R"({"samples_count": 768})") +
                                line("run_stop", "null", R"({"status": "success"})", 1000 + 90000) +
                                line("eval_accuracy", "0.91", R"({"samples_count": 1152})"));
  const auto run = mlperf::read_result_file(path);
  EXPECT_TRUE(run.converged);
  EXPECT_EQ(run.benchmark, "llama2_70b_lora");
  EXPECT_EQ(run.global_batch, 8);
  EXPECT_DOUBLE_EQ(run.minutes, 1.5);
  EXPECT_EQ(run.samples, 768);  // the last before run_stop, as rcp_checker
}

TEST(MlperfScore, BadFilesNameFileAndLine) {
  TempDir dir;
  const std::string path = dir.file("result_0.txt");
  const std::string start = line("run_start", "null", "{}");
  auto expect_bad = [&](const std::string& text, const std::vector<std::string>& fragments) {
    testing::write_file(path, text);
    expect_error([&] { mlperf::read_result_file(path); }, fragments);
  };
  expect_bad(":::MLLOG {\"namespace\": \n", {path + ":1", "not valid JSON"});
  expect_bad(start + ":::MLLOG [1]\n", {path + ":2", "must be a JSON object"});
  expect_bad(start + ":::MLLOG {\"namespace\": \"\", \"time_ms\": 1, \"key\": \"x\", \"value\": 1, \"metadata\": {}}\n",
             {path + ":2", "no 'event_type'"});
  expect_bad(start + start, {path + ":2", "a second run_start"});
  expect_bad(line("run_stop", "null", R"({"status": "success"})"), {path + ":1", "run_stop before any run_start"});
  expect_bad(start + line("run_stop", "null", "{}"), {path + ":2", "needs metadata.status"});
  expect_bad(start + line("eval_accuracy", "0.9", R"({"epoch_num": 1})"), {path + ":2", "samples_count"});
  expect_bad(start + line("global_batch_size", "8.5", "{}"), {path + ":2", "positive integer"});
  expect_bad(line("seed", "1", "{}"), {path, "no run_start"});
  expect_bad(start + line("run_stop", "null", R"({"status": "success"})"), {path, "no eval_accuracy before it"});
  // tracked_stats: an object of numbers, metadata.step a count; seed an integer.
  expect_bad(start + line("tracked_stats", "12.5", "{}"), {path + ":2", "tracked_stats' value must be a JSON object"});
  expect_bad(start + line("tracked_stats", "[12.5]", "{}"), {path + ":2", "JSON object"});
  expect_bad(start + line("tracked_stats", R"({"throughput": "fast"})", "{}"),
             {path + ":2", "tracked_stats' throughput must be a number", "fast"});
  expect_bad(start + line("tracked_stats", R"({"throughput": 1, "tflops_per_gpu": null})", "{}"),
             {path + ":2", "tflops_per_gpu must be a number"});
  expect_bad(start + line("tracked_stats", R"({"throughput": 1})", R"({"step": -4})"),
             {path + ":2", "metadata.step must be a non-negative integer"});
  expect_bad(start + line("tracked_stats", R"({"throughput": 1})", R"({"step": "x"})"), {path + ":2", "metadata.step"});
  expect_bad(line("seed", "\"abc\"", "{}") + start, {path + ":1", "seed must be an integer"});
  expect_bad(line("seed", "1.5", "{}") + start, {path + ":1", "seed must be an integer"});
  expect_bad(line("seed", "18446744073709551615", "{}") + start, {path + ":1", "seed must be an integer (64-bit)"});
}

TEST(MlperfScore, KeepsTheSeedTheEvalCurveAndTrackedStats) {
  TempDir dir;
  const std::string path = dir.file("result_0.txt");
  testing::write_file(
      path, line("seed", "4242", "{}") + line("run_start", "null", "{}") +
                line("tracked_stats", R"({"throughput": 12.5, "tokens_per_s_per_gpu": 12800, "tflops_per_gpu": 614.4})",
                     R"({"step": 384})") +
                line("eval_accuracy", "1.1", R"({"samples_count": 384})") +
                line("tracked_stats", R"({"throughput": 13, "train_loss": 1.2})", "{}") +  // an older file's
                line("eval_accuracy", "0.92", R"({"samples_count": 768})") + line("tracked_stats", "{}", "{}") +
                line("run_stop", "null", R"({"status": "success"})") +
                line("eval_accuracy", "0.91", R"({"samples_count": 1152})") +
                line("tracked_stats", R"({"throughput": 99})", "{}"));
  const auto run = mlperf::read_result_file(path);
  ASSERT_TRUE(run.seed.has_value());
  EXPECT_EQ(*run.seed, 4242);
  ASSERT_EQ(run.evals.size(), 2u);  // those before run_stop, as samples to converge
  EXPECT_EQ(run.evals[0].samples, 384);
  EXPECT_DOUBLE_EQ(run.evals[0].value, 1.1);
  EXPECT_EQ(run.evals[1].samples, 768);
  EXPECT_DOUBLE_EQ(run.evals[1].value, 0.92);
  ASSERT_EQ(run.tracked_stats.size(), 3u);
  const auto& full = run.tracked_stats[0];
  EXPECT_EQ(full.step, 384);
  EXPECT_EQ(full.throughput, 12.5);
  EXPECT_EQ(full.tokens_per_s_per_gpu, 12800.0);
  EXPECT_EQ(full.tflops_per_gpu, 614.4);
  const auto& older = run.tracked_stats[1];
  EXPECT_EQ(older.step, -1);
  EXPECT_EQ(older.throughput, 13.0);
  EXPECT_FALSE(older.tokens_per_s_per_gpu.has_value());
  EXPECT_FALSE(older.tflops_per_gpu.has_value());
  EXPECT_FALSE(run.tracked_stats[2].throughput.has_value());

  testing::write_file(path, line("run_start", "null", "{}"));
  const auto bare = mlperf::read_result_file(path);
  EXPECT_FALSE(bare.seed.has_value());
  EXPECT_TRUE(bare.evals.empty());
  EXPECT_TRUE(bare.tracked_stats.empty());
}

TEST(MlperfScore, RunsWithoutSuccessAreNotConverged) {
  TempDir dir;
  const std::string path = dir.file("result_0.txt");
  testing::write_file(path, line("run_start", "null", "{}") + line("run_stop", "null", R"({"status": "aborted"})"));
  auto run = mlperf::read_result_file(path);
  EXPECT_FALSE(run.converged);
  EXPECT_EQ(run.why_not, "run_stop status aborted");
  testing::write_file(path, line("run_start", "null", "{}"));
  run = mlperf::read_result_file(path);
  EXPECT_FALSE(run.converged);
  EXPECT_NE(run.why_not.find("no run_stop"), std::string::npos);
}

mlperf::ResultRun converged(double minutes, int64_t samples) {
  mlperf::ResultRun r;
  r.file = "result.txt";
  r.benchmark = "llama2_70b_lora";
  r.global_batch = 8;
  r.converged = true;
  r.minutes = minutes;
  r.samples = samples;
  return r;
}

TEST(MlperfScore, OlympicMeanDropsFastestAndSlowest) {
  std::vector<mlperf::ResultRun> runs;
  for (double m : {30.0, 20.0, 21.0, 22.0, 10.0}) runs.push_back(converged(m, 3072));
  auto s = mlperf::score_runs(runs, "");
  EXPECT_EQ(s.averaged_runs, 3);
  EXPECT_DOUBLE_EQ(s.mean_minutes, 21.0);
  EXPECT_EQ(s.required_runs, 10);
  EXPECT_EQ(s.rcp.message, "RCP found");
  EXPECT_NEAR(s.rcp.norm_factor, 3178.6666666666665 / 3072.0, 1e-12);
  EXPECT_NEAR(s.score_minutes, 21.0 * s.rcp.norm_factor, 1e-12);

  runs.back().converged = false;  // the unconverged run is the dropped slowest
  s = mlperf::score_runs(runs, "llama2_70b_lora");
  EXPECT_EQ(s.not_converged, 1);
  EXPECT_EQ(s.averaged_runs, 3);
  EXPECT_DOUBLE_EQ(s.mean_minutes, (21.0 + 22.0 + 30.0) / 3);

  runs.front().converged = false;
  expect_error([&] { mlperf::score_runs(runs, ""); }, {"2 of 5 runs did not converge"});
  expect_error([&] { mlperf::score_runs({converged(1, 3072), converged(2, 3072)}, ""); }, {"at least 3"});
  auto other = converged(1, 3072);
  other.global_batch = 16;
  expect_error([&] { mlperf::score_runs({converged(1, 3072), converged(2, 3072), other}, ""); },
               {"global_batch_size 16", "one set has one batch size"});
  expect_error([&] { mlperf::score_runs({converged(1, 3072), converged(2, 3072), converged(3, 3072)}, "resnet"); },
               {"submission_benchmark 'llama2_70b_lora'", "--benchmark is 'resnet'"});
}

TEST(MlperfRcp, StudentTMatchesScipy) {
  // scipy.stats.t.cdf values.
  EXPECT_NEAR(mlperf::student_t_cdf(-2.0, 10), 0.03669401738537018, 1e-13);
  EXPECT_NEAR(mlperf::student_t_cdf(1.5, 26), 0.9271696360729664, 1e-13);
  EXPECT_NEAR(mlperf::student_t_cdf(-0.3, 3), 0.3918816460199595, 1e-13);
  EXPECT_DOUBLE_EQ(mlperf::student_t_cdf(0.0, 7), 0.5);
}

TEST(MlperfScore, SummaryIsWhatTheCommandPrints) {
  std::vector<mlperf::ResultRun> runs;
  for (double m : {30.0, 20.0, 21.0, 22.0, 10.0}) runs.push_back(converged(m, 3072));
  EXPECT_EQ(mlperf::common_benchmark(runs, ""), "llama2_70b_lora");
  const auto s = mlperf::score_runs(runs, "");
  const auto lines = mlperf::score_summary(s);
  ASSERT_EQ(lines.size(), 6u);
  EXPECT_EQ(lines[0], std::make_pair(std::string("runs"), std::string("5 (5 converged; the olympic mean averages 3)")));
  EXPECT_EQ(lines[1].second, "21.0000 minutes");
  EXPECT_EQ(lines[2].first, "samples to converge");
  EXPECT_EQ(lines[3].second, "PASSED (RCP found)");
  EXPECT_EQ(lines[5].first, "score");
  EXPECT_NE(mlperf::incomplete_set_warning(s).find("the rules require 10"), std::string::npos);
  runs.back().benchmark = "llama31_8b";
  EXPECT_EQ(mlperf::common_benchmark(runs, ""), "");
  runs.back().benchmark = "";
  EXPECT_EQ(mlperf::common_benchmark(runs, ""), "llama2_70b_lora");
  EXPECT_EQ(mlperf::common_benchmark({}, "llama31_8b"), "llama31_8b");
}

TEST(MlperfRcp, UnknownBenchmarkIsAnError) {
  expect_error([] { mlperf::rcp_benchmark("resnet"); }, {"resnet", "llama31_8b, llama2_70b_lora and flux1"});
}

}  // namespace
}  // namespace forge
