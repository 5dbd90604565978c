// Bench reports: the markdown table (numbers, and none for failed runs), the JSON array
// (every field, config included), CSV quoting, and perf.csv appends (header, relative
// change across appends, and existing files that must be left untouched).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "bench/bench_report.h"
#include "bench/csv.h"
#include "bench/perf_csv.h"
#include "config_test_support.h"
#include "core/durable_file.h"
#include "test_data_temp_dir.h"
#include "train/metrics.h"
#include "file_testing.h"

namespace forge {
namespace {

using config_test::expect_error;

BenchResult ok_result(const std::string& model, int64_t micro_batch, double tflops, const std::string& args) {
  BenchResult r;
  r.model = model;
  r.precision = "bf16";
  r.micro_batch = micro_batch;
  r.seq_len = 8192;
  r.grad_accum = 1;
  r.global_batch = micro_batch;
  r.parallelism = "single";
  r.activation_checkpoint = "none";
  r.args = args;
  r.device_name = "NVIDIA H100 80GB HBM3";
  r.gpu_architecture = "sm_90";
  r.config = {{"model", {{"name", model}}}, {"training", {{"seq_len", 8192}}}};
  r.warmup_steps = 3;
  r.measured_steps = 10;
  r.step_time_median_s = 1.5;
  r.step_time_min_s = 1.25;
  r.step_time_max_s = 1.75;
  r.tokens_per_s_per_gpu = 43512.4;
  r.tflops_per_gpu = tflops;
  r.mfu = 0.4567;
  r.peak_memory_bytes = int64_t{3} << 30;
  r.duration_s = 42.31;
  return r;
}

BenchResult failed_result(const std::string& status, const std::string& error, const std::string& args) {
  BenchResult r = ok_result("llama3.1-8b", 8, 0, args);
  r.status = status;
  r.error = error;
  return r;
}

using testing::read_file;
using testing::write_file;

// perf.csv's records after the header, as fields.
std::vector<std::vector<std::string>> perf_rows(const std::string& path) {
  std::vector<std::vector<std::string>> rows;
  std::vector<CsvRecord> records = parse_csv(read_file(path), path);
  EXPECT_FALSE(records.empty());
  EXPECT_EQ(records.front().fields, perf_csv_columns());
  for (size_t i = 1; i < records.size(); ++i) rows.push_back(records[i].fields);
  return rows;
}

const std::string& column(const std::vector<std::string>& row, const std::string& name) {
  const auto& columns = perf_csv_columns();
  return row.at(std::find(columns.begin(), columns.end(), name) - columns.begin());
}

TEST(BenchMarkdown, RowsLikeTheSeedsTablesAndNoNumbersForFailures) {
  BenchResult fsdp = ok_result("llama3.1-8b", 3, 542.941, "--training.local_batch_size 3");
  fsdp.parallelism = "fsdp 8";
  BenchResult fast = ok_result("debug-tiny", 2, 0.5, "");
  fast.step_time_median_s = 0.0125;
  fast.step_time_min_s = 0.012;
  fast.step_time_max_s = 0.0131;
  fast.mfu.reset();
  fast.peak_memory_bytes = 0;
  const std::string table = bench_markdown_table(
      {fsdp, fast, failed_result("oom", "out of GPU memory", ""), failed_result("failed", "bad | thing\nhere", "")});
  std::istringstream lines(table);
  std::vector<std::string> rows;
  for (std::string line; std::getline(lines, line);) rows.push_back(line);
  ASSERT_EQ(rows.size(), 6u);
  EXPECT_EQ(rows[0],
            "| Model | Precision | Batch Size | Sequence Length | Accumulation | Checkpointing | TFLOP/s/GPU | "
            "Tokens/s/GPU | Step time (median, min-max) | MFU | Peak memory (GiB) | Status |");
  EXPECT_EQ(rows[1], "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---|");
  EXPECT_EQ(rows[2],
            "| llama3.1-8b with fsdp 8 | BF16 | 3 | 8192 | 1 | none | 542.94 | 43512 | 1.50 s (1.25-1.75) | 45.7% | "
            "3.00 | ok |");
  EXPECT_EQ(rows[3], "| debug-tiny | BF16 | 2 | 8192 | 1 | none | 0.50 | 43512 | 12.5 ms (12.0-13.1) | n/a | n/a | ok |");
  EXPECT_EQ(rows[4], "| llama3.1-8b | BF16 | 8 | 8192 | 1 | none | - | - | - | - | - | OOM |");
  EXPECT_EQ(rows[5], "| llama3.1-8b | BF16 | 8 | 8192 | 1 | none | - | - | - | - | - | failed: bad \\| thing here |");
}

BenchResult fp8_result(double tflops, const std::string& args) {
  BenchResult r = ok_result("llama3.1-8b", 1, tflops, args);
  r.fp8 = "tensorwise";
  r.mfu = tflops / *peak_tflops(r.device_name);
  r.mfu_fp8 = tflops / *peak_fp8_tflops(r.device_name);
  return r;
}

// An FP8 run names its recipe and adds its MFU against the fp8 peak; the columns stay.
TEST(BenchMarkdown, Fp8RunsShowTheRecipeAndBothMfus) {
  EXPECT_EQ(peak_tflops("NVIDIA H100 80GB HBM3"), 989.0);
  EXPECT_EQ(peak_fp8_tflops("NVIDIA H100 80GB HBM3"), 1979.0);
  EXPECT_EQ(peak_fp8_tflops("NVIDIA H200"), 1979.0);
  EXPECT_FALSE(peak_fp8_tflops("NVIDIA A100-SXM4-80GB").has_value());
  BenchResult unknown = fp8_result(0.5, "");
  unknown.mfu.reset();
  unknown.mfu_fp8.reset();
  BenchResult oom = failed_result("oom", "out of GPU memory", "");
  oom.fp8 = "tensorwise";
  const std::string table = bench_markdown_table({fp8_result(742.5, ""), unknown, oom});
  std::istringstream lines(table);
  std::vector<std::string> rows;
  for (std::string line; std::getline(lines, line);) rows.push_back(line);
  ASSERT_EQ(rows.size(), 5u);
  EXPECT_EQ(rows[2],
            "| llama3.1-8b | FP8 (tensorwise) | 1 | 8192 | 1 | none | 742.50 | 43512 | 1.50 s (1.25-1.75) | 75.1% "
            "(FP8 peak 37.5%) | 3.00 | ok |");
  EXPECT_EQ(rows[3],
            "| llama3.1-8b | FP8 (tensorwise) | 1 | 8192 | 1 | none | 0.50 | 43512 | 1.50 s (1.25-1.75) | n/a (FP8 "
            "peak n/a) | 3.00 | ok |");
  EXPECT_EQ(rows[4], "| llama3.1-8b | FP8 (tensorwise) | 8 | 8192 | 1 | none | - | - | - | - | - | OOM |");

  TempDir dir;
  write_bench_json(dir.file("bench.json"), {fp8_result(742.5, "")});
  const nlohmann::json json = nlohmann::json::parse(read_file(dir.file("bench.json")));
  EXPECT_EQ(json[0]["precision"], "bf16");
  EXPECT_EQ(json[0]["fp8"], "tensorwise");
  EXPECT_DOUBLE_EQ(json[0]["mfu"].get<double>(), 742.5 / 989.0);
  EXPECT_DOUBLE_EQ(json[0]["mfu_fp8"].get<double>(), 742.5 / 1979.0);
}

// NOTE [FP8 routed experts switch]: a MoE run with its routed experts in bf16 says so in the
// Precision column, perf.csv and the JSON.
TEST(BenchMarkdown, Fp8RunsWithRoutedExpertsInBf16SaySo) {
  BenchResult r = fp8_result(742.5, "");
  r.fp8_routed_experts = false;
  EXPECT_EQ(precision_label(r), "FP8 (tensorwise, routed experts bf16)");
  EXPECT_EQ(precision_label(fp8_result(742.5, "")), "FP8 (tensorwise)");
  TempDir dir;
  write_bench_json(dir.file("bench.json"), {r, fp8_result(742.5, "")});
  const nlohmann::json json = nlohmann::json::parse(read_file(dir.file("bench.json")));
  EXPECT_EQ(json[0]["fp8_routed_experts"], false);
  EXPECT_EQ(json[1]["fp8_routed_experts"], true);
  append_perf_csv(dir.file("perf.csv"), {r}, PerfCsvContext{"host", ""});
  EXPECT_EQ(column(perf_rows(dir.file("perf.csv"))[0], "training_precision"), "fp8 (tensorwise, routed experts bf16)");
}

// NOTE [FP8 filter]: the projections precision.fp8_filter_fqns keeps in bf16 are in the
// Precision column, perf.csv (quoted: the list has commas) and the JSON, read back as written.
TEST(BenchMarkdown, Fp8RunsWithAFilterSaySo) {
  BenchResult r = fp8_result(742.5, "");
  r.fp8_filter_fqns = "layers.0.,layers.31.";
  EXPECT_EQ(precision_label(r), "FP8 (tensorwise, bf16: layers.0.,layers.31.)");
  r.fp8_routed_experts = false;
  EXPECT_EQ(precision_label(r), "FP8 (tensorwise, routed experts bf16, bf16: layers.0.,layers.31.)");
  TempDir dir;
  write_bench_json(dir.file("bench.json"), {r});
  const nlohmann::json json = nlohmann::json::parse(read_file(dir.file("bench.json")));
  EXPECT_EQ(json[0]["fp8_filter_fqns"], "layers.0.,layers.31.");
  append_perf_csv(dir.file("perf.csv"), {r}, PerfCsvContext{"host", ""});
  EXPECT_EQ(column(perf_rows(dir.file("perf.csv"))[0], "training_precision"),
            "fp8 (tensorwise, routed experts bf16, bf16: layers.0.,layers.31.)");
}

// NOTE [FP8 weight gradient switch]: a run with its weight gradients in bf16 says so too, and
// the JSON keeps the switch.
TEST(BenchMarkdown, Fp8RunsWithWeightGradientsInBf16SaySo) {
  BenchResult r = fp8_result(742.5, "");
  r.fp8_weight_gradient = false;
  EXPECT_EQ(precision_label(r), "FP8 (tensorwise, weight gradients bf16)");
  r.fp8_filter_fqns = "layers.0.";
  EXPECT_EQ(precision_label(r), "FP8 (tensorwise, weight gradients bf16, bf16: layers.0.)");
  TempDir dir;
  write_bench_json(dir.file("bench.json"), {r, fp8_result(742.5, "")});
  const nlohmann::json json = nlohmann::json::parse(read_file(dir.file("bench.json")));
  EXPECT_EQ(json[0]["fp8_weight_gradient"], false);
  EXPECT_EQ(json[1]["fp8_weight_gradient"], true);
  append_perf_csv(dir.file("perf.csv"), {r}, PerfCsvContext{"host", ""});
  EXPECT_EQ(column(perf_rows(dir.file("perf.csv"))[0], "training_precision"),
            "fp8 (tensorwise, weight gradients bf16, bf16: layers.0.)");
}

// perf.csv's training_precision names the recipe, and a run's relative change is against
// earlier rows of its own precision only.
TEST(PerfCsv, Fp8RowsNameTheRecipeAndCompareWithFp8RowsOnly) {
  TempDir dir;
  const std::string path = dir.file("perf.csv");
  const PerfCsvContext context{"host", ""};
  append_perf_csv(path, {fp8_result(700, "x"), ok_result("llama3.1-8b", 1, 400, "x")}, context);
  append_perf_csv(path, {fp8_result(770, "x"), ok_result("llama3.1-8b", 1, 440, "x")}, context);
  const auto rows = perf_rows(path);
  ASSERT_EQ(rows.size(), 4u);
  EXPECT_EQ(column(rows[0], "training_precision"), "fp8 (tensorwise)");
  EXPECT_EQ(column(rows[1], "training_precision"), "bf16");
  EXPECT_EQ(column(rows[1], "relative_change"), "");
  EXPECT_EQ(column(rows[2], "relative_change"), "10.00");
  EXPECT_EQ(column(rows[3], "relative_change"), "10.00");
}

TEST(BenchJson, EveryFieldWrittenAtomically) {
  TempDir dir;
  const std::string path = dir.file("bench.json");
  write_file(path, "old contents");
  BenchResult unknown_peak = ok_result("llama3.1-8b", 2, 400, "--training.local_batch_size 2");
  unknown_peak.mfu.reset();
  write_bench_json(path, {ok_result("llama3.1-8b", 1, 412.5, "--training.local_batch_size 1"), unknown_peak,
                          failed_result("oom", "out of GPU memory", "--training.local_batch_size 8")});
  EXPECT_FALSE(std::filesystem::exists(temporary_path_for(path, ::getpid())));
  const nlohmann::json json = nlohmann::json::parse(read_file(path));
  ASSERT_TRUE(json.is_array());
  ASSERT_EQ(json.size(), 3u);
  const nlohmann::json& first = json[0];
  for (const char* key : {"model", "precision", "micro_batch", "seq_len", "grad_accum", "global_batch", "n_gpus",
                          "parallelism", "activation_checkpoint", "args", "device_name", "gpu_architecture", "config",
                          "status", "error", "warmup_steps", "measured_steps", "step_time_median_s",
                          "step_time_min_s", "step_time_max_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu",
                          "peak_memory_bytes", "duration_s", "fp8", "fp8_routed_experts", "fp8_filter_fqns", "fp8_weight_gradient",
                          "mfu_fp8"}) {
    EXPECT_TRUE(first.contains(key)) << key;
  }
  EXPECT_EQ(first.size(), 31u);
  EXPECT_EQ(first["fp8"], "none");
  EXPECT_TRUE(first["mfu_fp8"].is_null());
  EXPECT_EQ(first["model"], "llama3.1-8b");
  EXPECT_EQ(first["micro_batch"], 1);
  EXPECT_DOUBLE_EQ(first["tflops_per_gpu"].get<double>(), 412.5);
  EXPECT_DOUBLE_EQ(first["mfu"].get<double>(), 0.4567);
  EXPECT_EQ(first["peak_memory_bytes"], int64_t{3} << 30);
  EXPECT_EQ(first["config"]["model"]["name"], "llama3.1-8b");
  EXPECT_EQ(first["args"], "--training.local_batch_size 1");
  EXPECT_TRUE(json[1]["mfu"].is_null());
  EXPECT_EQ(json[2]["status"], "oom");
  EXPECT_EQ(json[2]["error"], "out of GPU memory");
}

TEST(BenchJson, UnwritablePathIsAnError) {
  TempDir dir;
  expect_error([&] { write_bench_json(dir.file("missing/bench.json"), {}); }, {"missing/bench.json.tmp"});
}

TEST(Csv, QuotesOnlyWhatNeedsItAndReadsItBack) {
  const std::vector<std::string> fields = {"plain", "two words", "a,b", "say \"hi\"", "line\nbreak", ""};
  const std::string line = csv_line(fields);
  EXPECT_EQ(line, "plain,two words,\"a,b\",\"say \"\"hi\"\"\",\"line\nbreak\",\n");
  const std::vector<CsvRecord> records = parse_csv(line + "x,y\r\n\n\"\",last", "f.csv");
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0].fields, fields);
  EXPECT_EQ(records[0].line, 1);
  EXPECT_EQ(records[1].fields, (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(records[1].line, 3);
  EXPECT_EQ(records[2].fields, (std::vector<std::string>{"", "last"}));
  EXPECT_EQ(records[2].line, 5);
}

TEST(Csv, RejectsUnclosedQuotesAndTextAfterAClosingQuote) {
  expect_error([] { parse_csv("a,b\nc,\"open\nstill open", "perf.csv"); }, {"perf.csv:2", "never closed"});
  expect_error([] { parse_csv("a,\"b\"c\n", "perf.csv"); }, {"perf.csv:1", "after the closing quote"});
}

TEST(PerfCsv, CreatesTheFileWithMadsColumns) {
  TempDir dir;
  const std::string path = dir.file("perf.csv");
  BenchResult fsdp = ok_result("llama3.1-8b", 3, 542.941, "--training.local_batch_size 3 --data.path /d/a,b");
  fsdp.n_gpus = 8;
  fsdp.parallelism = "fsdp 8";
  fsdp.activation_checkpoint = "full";
  append_perf_csv(path, {fsdp, failed_result("oom", "out of memory", "--training.local_batch_size 9")},
                  PerfCsvContext{"node-7", "nightly"});
  const std::string text = read_file(path);
  EXPECT_TRUE(text.starts_with(
      "model,n_gpus,training_precision,pipeline,args,tags,machine_name,gpu_architecture,performance,metric,"
      "relative_change,status,build_duration,test_duration\n"));
  EXPECT_NE(text.find("llama3.1-8b,8,bf16,nightly,\"--training.local_batch_size 3 --data.path /d/a,b\","
                      "\"forge,fsdp 8,full\",node-7,sm_90,542.94,TFLOPS_per_gpu,,SUCCESS,,42.3\n"),
            std::string::npos)
      << text;
  const auto rows = perf_rows(path);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(column(rows[1], "status"), "FAILURE");
  EXPECT_EQ(column(rows[1], "performance"), "");
  EXPECT_EQ(column(rows[1], "relative_change"), "");
  EXPECT_EQ(column(rows[1], "test_duration"), "42.3");
}

TEST(PerfCsv, RelativeChangeAgainstTheLatestRowWithTheSameModelAndArgs) {
  TempDir dir;
  const std::string path = dir.file("perf.csv");
  const std::string a = "--training.local_batch_size 1", b = "--training.local_batch_size 2";
  const PerfCsvContext context{"host", ""};
  append_perf_csv(path, {ok_result("llama3.1-8b", 1, 400, a), ok_result("llama3.1-8b", 2, 500, b)}, context);
  // Same args, another model: no history. A failure in between is skipped.
  append_perf_csv(path, {ok_result("mistral-7b-v0.1", 1, 300, a), failed_result("failed", "crash", a)}, context);
  append_perf_csv(path, {ok_result("llama3.1-8b", 1, 420, a), ok_result("llama3.1-8b", 2, 450, b)}, context);
  // Within one append, a row sees the rows appended before it.
  append_perf_csv(path, {ok_result("llama3.1-8b", 1, 315, a), ok_result("llama3.1-8b", 1, 630, a)}, context);
  const auto rows = perf_rows(path);
  ASSERT_EQ(rows.size(), 8u);
  std::vector<std::string> changes;
  for (const auto& row : rows) changes.push_back(column(row, "relative_change"));
  EXPECT_EQ(changes, (std::vector<std::string>{"", "", "", "", "5.00", "-10.00", "-25.00", "100.00"}));
}

TEST(PerfCsv, ExistingFileWithoutTrailingNewlineOrWithBlankLinesIsAppendedCleanly) {
  TempDir dir;
  const std::string path = dir.file("perf.csv");
  append_perf_csv(path, {ok_result("llama3.1-8b", 1, 400, "x")}, {"host", ""});
  std::string text = read_file(path);
  text.pop_back();
  write_file(path, text + "\n\n");
  append_perf_csv(path, {ok_result("llama3.1-8b", 1, 440, "x")}, {"host", ""});
  write_file(path, read_file(path).substr(0, read_file(path).size() - 1));
  append_perf_csv(path, {ok_result("llama3.1-8b", 1, 484, "x")}, {"host", ""});
  const auto rows = perf_rows(path);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(column(rows[2], "relative_change"), "10.00");
  write_file(path, "");
  append_perf_csv(path, {ok_result("llama3.1-8b", 1, 400, "x")}, {"host", ""});
  EXPECT_EQ(perf_rows(path).size(), 1u);
}

TEST(PerfCsv, MalformedExistingFileIsAnErrorAndNothingIsWritten) {
  TempDir dir;
  const std::string path = dir.file("perf.csv");
  const std::vector<BenchResult> results = {ok_result("llama3.1-8b", 1, 400, "x")};
  struct Case {
    std::string text;
    std::vector<std::string> fragments;
  };
  const std::string header =
      "model,n_gpus,training_precision,pipeline,args,tags,machine_name,gpu_architecture,performance,metric,"
      "relative_change,status,build_duration,test_duration\n";
  for (const Case& c : std::vector<Case>{
           {"model,performance,metric\nx,1,y\n", {"perf.csv:1", "not a forge perf.csv header",
                                                  "column 2 is 'performance', expected 'n_gpus'", "nothing"}},
           {header.substr(0, header.size() - 15) + "\n", {"column 14 'test_duration' is missing"}},
           {header.substr(0, header.size() - 1) + ",extra\n", {"column 15 'extra' is not one of them"}},
           {header + "a,1,bf16,,x,forge,h,sm_90,1.0,TFLOPS_per_gpu,,SUCCESS,,1.0\nshort,row\n",
            {"perf.csv:3", "a row of 2 fields, the header has 14"}},
           {header + "a,1,bf16,,\"x,forge,h,sm_90,1.0\n", {"perf.csv:2", "never closed"}},
       }) {
    write_file(path, c.text);
    try {
      append_perf_csv(path, results, {"host", ""});
      ADD_FAILURE() << "no error for:\n" << c.text;
    } catch (const Error& error) {
      for (const std::string& fragment : c.fragments) EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
    }
    EXPECT_EQ(read_file(path), c.text);
    EXPECT_FALSE(std::filesystem::exists(temporary_path_for(path, ::getpid())));
  }
  expect_error([&] { append_perf_csv(dir.file(""), results, {"host", ""}); }, {"is not a file"});
}

}  // namespace
}  // namespace forge
