// The page of `forge mlperf score --html` (bench/mlperf_report.h): the summary, a row per
// run with the means of its tracked_stats ("-" for what no line holds), the eval curves
// with the target line, and a page without a score that says why. End to end through the
// command and the synthetic result files: tests/python/test_mlperf_logging.py.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "bench/mlperf_report.h"
#include "train/mlperf_score.h"

namespace forge {
namespace {

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

mlperf::ResultRun lora_run(int index, double minutes) {
  mlperf::ResultRun r;
  r.file = "runs/result_" + std::to_string(index) + ".txt";
  r.benchmark = "llama2_70b_lora";
  r.global_batch = 8;
  r.seed = 100 + index;
  r.converged = true;
  r.minutes = minutes;
  r.samples = 3072;
  r.evals = {{384, 1.1}, {1536, 0.98}, {3072, 0.921}};
  r.last_eval = 0.921;
  mlperf::TrackedStats a, b;
  a.throughput = 10;
  a.tokens_per_s_per_gpu = 10240;
  a.tflops_per_gpu = 400;
  b.throughput = 14;
  b.tokens_per_s_per_gpu = 14336;
  b.tflops_per_gpu = 600;
  r.tracked_stats = {a, b};
  return r;
}

TEST(MlperfReport, ShowsTheScoreEveryRunAndTheEvalCurves) {
  std::vector<mlperf::ResultRun> runs = {lora_run(0, 20), lora_run(1, 21), lora_run(2, 22)};
  runs[1].tracked_stats = {runs[1].tracked_stats[0]};  // tokens and TFLOP/s from one line
  runs[1].tracked_stats[0].tflops_per_gpu.reset();
  runs[2].tracked_stats.clear();  // an older file: no tracked_stats
  runs[2].seed.reset();
  runs[2].file = "runs/result_<2>.txt";
  MlperfReport report{"runs", runs, mlperf::score_runs(runs, ""), "", "llama2_70b_lora"};
  const std::string html = render_mlperf_report(report, "2026-01-01 00:00 UTC");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("</html>"), std::string::npos);
  EXPECT_NE(html.find("<h1>MLPerf Training: llama2_70b_lora</h1>"), std::string::npos);
  for (const auto& [label, text] : mlperf::score_summary(*report.score))
    EXPECT_NE(html.find("<tr><th>" + label + "</th><td>" + text + "</td></tr>"), std::string::npos) << label;
  EXPECT_NE(html.find("mean time-to-train</th><td>21.0000 minutes"), std::string::npos);
  EXPECT_NE(html.find("the rules require 10"), std::string::npos);
  // The means: (10 + 14) / 2 samples/s, (10240 + 14336) / 2 tokens/s/GPU, (400 + 600) / 2 TFLOP/s.
  EXPECT_NE(html.find("result_0.txt</td><td class=\"num\">100</td><td class=\"status-ok\">converged</td><td "
                      "class=\"num\">20.0000</td><td class=\"num\">3072</td><td class=\"num\">0.9210</td><td "
                      "class=\"num\">12.00</td><td class=\"num\">12,288</td><td class=\"num\">500.0</td></tr>"),
            std::string::npos)
      << html;
  EXPECT_NE(html.find("<td class=\"num\">10.00</td><td class=\"num\">10,240</td><td class=\"num\">-</td></tr>"),
            std::string::npos);
  EXPECT_NE(html.find("result_&lt;2&gt;.txt</td><td class=\"num\">-</td>"), std::string::npos);
  EXPECT_NE(html.find("<td class=\"num\">-</td><td class=\"num\">-</td><td class=\"num\">-</td></tr>"),
            std::string::npos);
  EXPECT_EQ(html.find("result_<2>"), std::string::npos);
  // One chart: a line and dots per run, the target dashed across it.
  EXPECT_EQ(occurrences(html, "<svg "), 1u);
  EXPECT_EQ(occurrences(html, "<polyline "), 3u);
  EXPECT_EQ(occurrences(html, "<circle "), 9u);
  EXPECT_EQ(occurrences(html, "<line class=\"target\""), 1u);
  EXPECT_NE(html.find(">target 0.925</text>"), std::string::npos);
  EXPECT_NE(html.find("<title>result_0.txt: samples 3072, 0.921</title>"), std::string::npos);
}

TEST(MlperfReport, ASetWithoutAScoreStillShowsItsRuns) {
  std::vector<mlperf::ResultRun> runs = {lora_run(0, 20), lora_run(1, 21)};
  runs[1].converged = false;
  runs[1].why_not = "run_stop status aborted";
  MlperfReport report{"runs", runs, std::nullopt, "2 runs: the olympic mean needs at least 3", "llama2_70b_lora"};
  const std::string html = render_mlperf_report(report, "now");
  EXPECT_NE(html.find("No score: 2 runs: the olympic mean needs at least 3"), std::string::npos);
  EXPECT_EQ(html.find("normalization factor"), std::string::npos);
  EXPECT_NE(html.find("result_1.txt"), std::string::npos);
  EXPECT_NE(html.find("<td class=\"status-bad\">not converged: run_stop status aborted</td><td class=\"num\">-</td>"),
            std::string::npos);
  EXPECT_EQ(occurrences(html, "<polyline "), 2u);

  report.benchmark = "";  // the logs disagree or name none: no target to draw
  const std::string untargeted = render_mlperf_report(report, "now");
  EXPECT_NE(untargeted.find("<h1>MLPerf Training</h1>"), std::string::npos);
  EXPECT_EQ(untargeted.find("class=\"target\""), std::string::npos);
  report.benchmark = "resnet";
  EXPECT_EQ(render_mlperf_report(report, "now").find("class=\"target\""), std::string::npos);
}

}  // namespace
}  // namespace forge
