// forge report's library half: reading run directories (and refusing bad ones with the
// file and line), the chart arithmetic, escaping, and the rendered page's contents.
// tests/python/test_report.py drives the command end to end on real runs.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>

#include "expect_error.h"
#include "bench/report_chart.h"
#include "bench/report_data.h"
#include "bench/report_html.h"
#include "bench/report_page.h"
#include "core/error.h"
#include "test_data_temp_dir.h"
#include "file_testing.h"

namespace forge {
namespace {

const char* kRunRecord = R"({"type": "run", "model": "debug-tiny", "parameters": 1000, "device": "cpu"})";

std::string train_record(int step, double loss) {
  return fmt::format(R"({{"type": "train", "step": {}, "loss": {}, "lr": 0.001, "grad_norm": 1.0, "step_time_s": 0.5,)"
                     R"( "tokens_per_s": 2048.0, "model_tflops": 0.01, "mfu": null}})",
                     step, loss);
}

using testing::write_file;

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(Report, Escapes) {
  EXPECT_EQ(html_escape(R"(a<b>&"c'd)"), "a&lt;b&gt;&amp;&quot;c&#39;d");
  EXPECT_EQ(html_escape("plain"), "plain");
}

TEST(Report, NiceTicks) {
  EXPECT_EQ(nice_ticks(0, 10, 5), (std::vector<double>{0, 2, 4, 6, 8, 10}));
  EXPECT_EQ(nice_ticks(2.3, 9.7, 5), (std::vector<double>{2, 4, 6, 8, 10}));
  EXPECT_EQ(nice_ticks(0, 0.9, 4), (std::vector<double>{0, 0.5, 1}));
  EXPECT_EQ(nice_ticks(1200, 4900, 4), (std::vector<double>{1000, 2000, 3000, 4000, 5000}));
  const std::vector<double> one = nice_ticks(5, 5, 5);  // a single value gets a span around it
  EXPECT_LT(one.front(), 5);
  EXPECT_GT(one.back(), 5);
}

TEST(Report, TickLabels) {
  EXPECT_EQ(format_tick(0), "0");
  EXPECT_EQ(format_tick(0.25), "0.25");
  EXPECT_EQ(format_tick(250), "250");
  EXPECT_EQ(format_tick(12000), "12k");
  EXPECT_EQ(format_tick(1500000), "1.5M");
  EXPECT_EQ(format_tick(2e9), "2G");
}

TEST(Report, ReadsARunAndDropsWhatAResumeSupersedes) {
  TempDir dir;
  write_file(dir.file("metrics.jsonl"), std::string(kRunRecord) + "\n" + train_record(1, 5.0) + "\n" +
                                       train_record(2, 4.0) + "\n" + train_record(3, 3.0) + "\n" +
                                       R"({"type": "eval", "step": 3, "loss": 3.5, "perplexity": 33.1})" "\n" +
                                       kRunRecord + "\n" + R"({"type": "resume", "step": 2})" "\n" +
                                       train_record(3, 2.9) + "\n");
  write_file(dir.file("config.yaml"),
        "training:\n  local_batch_size: 4\n  gradient_accumulation_steps: 2\n  global_batch_size: 8\n"
        "  seq_len: 128\nprecision:\n  compute_dtype: fp32\n");
  const ReportRun run = load_report_run(dir.file(""));
  EXPECT_TRUE(run.has_metrics);
  EXPECT_EQ(run.model, "debug-tiny");
  EXPECT_EQ(run.parameters, 1000);
  ASSERT_EQ(run.steps.size(), 3u);
  EXPECT_EQ(run.steps[2].loss, 2.9);
  EXPECT_FALSE(run.steps[2].mfu);
  EXPECT_TRUE(run.evals.empty());  // the eval at step 3 belonged to the superseded part
  EXPECT_EQ(run.global_batch, 8);
  EXPECT_EQ(run.micro_batch, 4);
  EXPECT_EQ(run.seq_len, 128);
  EXPECT_EQ(run.precision, "fp32");
  EXPECT_TRUE(run.bench.empty());
}

TEST(Report, RefusesBadRunDirectories) {
  TempDir dir;
  expect_error([&] { load_report_run(dir.file("missing")); }, {"missing", "not found"});
  expect_error([&] { load_report_run(dir.file("")); }, {"holds no metrics.jsonl (nor bench.json)"});
  write_file(dir.file("metrics.jsonl"), std::string(kRunRecord) + "\n" + train_record(1, 5.0) + "\n{\"type\": \"train\", \n");
  expect_error([&] { load_report_run(dir.file("")); }, {"metrics.jsonl:3", "not valid JSON"});
  write_file(dir.file("metrics.jsonl"), std::string(kRunRecord) + "\n" + R"({"type": "train", "step": 1})" "\n");
  expect_error([&] { load_report_run(dir.file("")); }, {"metrics.jsonl:2", "missing 'loss'"});
  write_file(dir.file("metrics.jsonl"), std::string(kRunRecord) + "\n[1, 2]\n");
  expect_error([&] { load_report_run(dir.file("")); }, {"metrics.jsonl:2", "expected a JSON object"});
  write_file(dir.file("metrics.jsonl"), train_record(1, 5.0) + "\n");
  expect_error([&] { load_report_run(dir.file("")); }, {"metrics.jsonl", "no run record"});
}

TEST(Report, ReadsAndRefusesBenchResults) {
  TempDir dir;
  write_file(dir.file("bench.json"), R"([{"model": "llama3.1-8b", "precision": "bf16", "micro_batch": 2, "seq_len": 8192,
      "tflops_per_gpu": 612.5, "tokens_per_s_per_gpu": 7890.1, "peak_memory_bytes": 70000000000, "status": "ok",
      "mfu": 0.62, "n_gpus": 8, "extra_field": [1]},
    {"model": "llama3.1-70b", "status": "oom", "error": "out of memory at micro_batch 4"}])");
  const std::vector<BenchResult> results = load_bench_results(dir.file("bench.json"));
  ASSERT_EQ(results.size(), 2u);
  EXPECT_EQ(results[0].micro_batch, 2);
  EXPECT_EQ(results[0].tflops_per_gpu, 612.5);
  EXPECT_EQ(results[0].mfu, 0.62);
  EXPECT_EQ(results[1].status, "oom");
  EXPECT_FALSE(results[1].mfu);
  write_file(dir.file("bench.json"), R"({"model": "x"})");
  expect_error([&] { load_bench_results(dir.file("bench.json")); }, {"bench.json", "expected a JSON array"});
  write_file(dir.file("bench.json"), R"([{"model": "x", "status": "ok"}, {"status": "ok"}])");
  expect_error([&] { load_bench_results(dir.file("bench.json")); }, {"bench.json entry 2", "missing 'model'"});
  write_file(dir.file("bench.json"), R"([{"model": "x", "status": "ok", "micro_batch": "two"}])");
  expect_error([&] { load_bench_results(dir.file("bench.json")); }, {"entry 1", "'micro_batch' must be an integer"});
  write_file(dir.file("bench.json"), "[{");
  expect_error([&] { load_bench_results(dir.file("bench.json")); }, {"bench.json", "not valid JSON"});
}

TEST(Report, ReadsABenchOutputDirectory) {
  // forge bench's --output-dir: bench.json, and the runs in subdirectories.
  TempDir dir;
  write_file(dir.file("bench.json"), R"([{"model": "llama3.1-8b", "status": "ok", "tflops_per_gpu": 612.5}])");
  ReportRun bench = load_report_run(dir.file(""));
  EXPECT_FALSE(bench.has_metrics);
  ASSERT_EQ(bench.bench.size(), 1u);
  bench.name = "bench";
  const std::string html = render_report({bench}, "now");
  EXPECT_NE(html.find("Benchmark: bench"), std::string::npos);
  EXPECT_NE(html.find("612.5"), std::string::npos);
  EXPECT_EQ(html.find("<svg "), std::string::npos);
  EXPECT_EQ(html.find("class=\"runs\""), std::string::npos);
}

ReportRun sample_run(const std::string& name, bool with_memory) {
  ReportRun run;
  run.dir = "runs/" + name;
  run.name = name;
  run.has_metrics = true;
  run.model = "debug-tiny";
  run.device = "NVIDIA H100 80GB HBM3";
  run.parameters = 2'500'000;
  run.global_batch = 8;
  run.seq_len = 128;
  for (int s = 1; s <= 10; ++s) {
    StepMetrics m;
    m.step = s;
    m.loss = 6.0 - 0.3 * s;
    m.tokens_per_s = 1000.0 * s;
    m.model_tflops = 0.5;
    m.step_time_s = 0.2;
    m.mfu = 0.4;
    if (with_memory) m.peak_memory_bytes = int64_t{1} << 30;
    run.steps.push_back(m);
  }
  run.evals.push_back({.step = 5, .loss = 4.6, .perplexity = 99.5, .tokens = 512});
  run.evals.push_back({.step = 10, .loss = 3.2, .perplexity = 24.5, .tokens = 512});
  return run;
}

TEST(Report, RendersEveryRunsSeriesAndTables) {
  ReportRun a = sample_run("run <a> & \"b\"", true);
  BenchResult ok;
  ok.model = "llama3.1-8b";
  ok.tokens_per_s_per_gpu = 7890.4;
  ok.tflops_per_gpu = 612.5;
  BenchResult oom;
  oom.model = "llama3.1-70b";
  oom.status = "oom";
  oom.error = "<out of memory>";
  a.bench = {ok, oom};
  const std::string html = render_report({a, sample_run("b", false)}, "2025-01-01 00:00 UTC");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("</html>"), std::string::npos);
  // Loss, tokens/s, TFLOP/s: a line per run in each chart, and the evals as dots; memory:
  // a line for the run that measured it.
  EXPECT_EQ(occurrences(html, "<svg "), 4u);
  EXPECT_EQ(occurrences(html, "<polyline "), 7u);
  EXPECT_EQ(occurrences(html, "<circle "), 4u);
  EXPECT_NE(html.find("run &lt;a&gt; &amp; &quot;b&quot;"), std::string::npos);
  EXPECT_EQ(html.find("run <a>"), std::string::npos);
  EXPECT_NE(html.find("&lt;out of memory&gt;"), std::string::npos);
  EXPECT_NE(html.find("Benchmark: run &lt;a&gt;"), std::string::npos);
  EXPECT_NE(html.find("7,890"), std::string::npos);
  EXPECT_NE(html.find("612.5"), std::string::npos);
  EXPECT_NE(html.find("40.0%"), std::string::npos);  // median MFU
  EXPECT_NE(html.find("5,500"), std::string::npos);  // median tokens/s
  EXPECT_NE(html.find("2.50 M"), std::string::npos);
  EXPECT_NE(html.find("1.00 GiB"), std::string::npos);
  EXPECT_EQ(occurrences(html, "Benchmark: "), 1u);
}

// A precision.fp8 run: its precision from config.yaml, and its MFU against the fp8 peak
// (metrics.jsonl's mfu_fp8, bench.json's mfu_fp8) under the bf16 one.
TEST(Report, Fp8RunsShowTheRecipeAndTheFp8PeakMfu) {
  TempDir dir;
  std::string record = train_record(1, 5.0);
  record.replace(record.find(R"("mfu": null)"), 11, R"("mfu": 0.6, "mfu_fp8": 0.3)");
  write_file(dir.file("metrics.jsonl"), std::string(kRunRecord) + "\n" + record + "\n");
  write_file(dir.file("config.yaml"),
             "training:\n  seq_len: 128\nprecision:\n  compute_dtype: bf16\n  fp8: tensorwise\n");
  ReportRun run = load_report_run(dir.file(""));
  EXPECT_EQ(run.precision, "FP8 (tensorwise)");
  ASSERT_EQ(run.steps.size(), 1u);
  EXPECT_EQ(run.steps[0].mfu_fp8, 0.3);
  // NOTE [FP8 weight gradient switch] and NOTE [FP8 filter]: the GEMMs the config keeps out of FP8.
  write_file(dir.file("config.yaml"), "training:\n  seq_len: 128\nprecision:\n  compute_dtype: bf16\n  fp8: delayed\n"
                                      "  fp8_weight_gradient: false\n  fp8_filter_fqns: layers.0.\n");
  EXPECT_EQ(load_report_run(dir.file("")).precision, "FP8 (delayed, weight gradients bf16, bf16: layers.0.)");
  write_file(dir.file("config.yaml"),
             "training:\n  seq_len: 128\nprecision:\n  compute_dtype: bf16\n  fp8: tensorwise\n");
  BenchResult bench;
  bench.model = "llama3.1-8b";
  bench.precision = "bf16";
  bench.fp8 = "tensorwise";
  bench.mfu = 0.75;
  bench.mfu_fp8 = 0.375;
  bench.tflops_per_gpu = 742;
  run.bench = {bench};
  const std::string html = render_report({run}, "now");
  EXPECT_EQ(occurrences(html, "FP8 (tensorwise)"), 2u);  // the runs table and the benchmark's
  EXPECT_NE(html.find("60.0%<div class=\"sub\">FP8 peak 30.0%</div>"), std::string::npos);
  EXPECT_NE(html.find("75.0%<div class=\"sub\">FP8 peak 37.5%</div>"), std::string::npos);
  write_file(dir.file("config.yaml"), "training:\n  seq_len: 128\nprecision:\n  fp8: [tensorwise]\n");
  expect_error([&] { load_report_run(dir.file("")); }, {"precision.fp8 must be a name"});
  // forge train's step line: both figures.
  EXPECT_NE(format_step(run.steps[0], 10).find("MFU  60.0% (FP8 peak 30.0%)"), std::string::npos);
}

TEST(Report, LeavesOutTheMemoryChartWhenNoRunMeasuredIt) {
  const std::string html = render_report({sample_run("a", false)}, "now");
  EXPECT_EQ(occurrences(html, "<svg "), 3u);
  EXPECT_EQ(html.find("Peak device memory"), std::string::npos);
}

}  // namespace
}  // namespace forge
