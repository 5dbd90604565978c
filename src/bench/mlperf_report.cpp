#include "bench/mlperf_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "bench/report_chart.h"
#include "bench/report_page.h"
#include "train/mlperf_rcp.h"

namespace forge {
namespace {

constexpr const char* kMissing = "-";

std::string file_name(const mlperf::ResultRun& run) { return std::filesystem::path(run.file).filename().string(); }

// The mean of one tracked_stats member over the records that hold it.
std::string tracked_mean(const std::vector<mlperf::TrackedStats>& records,
                         std::optional<double> mlperf::TrackedStats::*member, std::string (*format)(double)) {
  double sum = 0;
  int n = 0;
  for (const auto& r : records)
    if (const auto& v = r.*member) {
      sum += *v;
      ++n;
    }
  return n == 0 ? kMissing : format(sum / n);
}

std::string samples_per_s(double v) { return fmt::format("{:.2f}", v); }

std::string summary(const MlperfReport& report) {
  if (!report.score)
    return "<p class=\"status-bad\">No score: " + html_escape(report.no_score) + "</p>\n";
  const mlperf::Score& s = *report.score;
  std::string html = "<table class=\"summary\">\n";
  for (const auto& [label, text] : mlperf::score_summary(s))
    html += "<tr><th>" + html_escape(label) + "</th>" + html_cell(text) + "</tr>\n";
  html += "</table>\n";
  if (const std::string warning = mlperf::incomplete_set_warning(s); !warning.empty())
    html += "<p class=\"note\">" + html_escape(warning) + "</p>\n";
  return html;
}

std::string runs_table(const std::vector<mlperf::ResultRun>& runs) {
  std::string html = "<div class=\"scroll\"><table class=\"runs\">\n";
  html += html_header_row({{"Run", false}, {"Seed", true}, {"Status", false}, {"Minutes", true},
                           {"Samples to converge", true}, {"Last eval", true}, {"Samples/s", true},
                           {"Tokens/s/GPU", true}, {"TFLOP/s/GPU", true}});
  for (size_t i = 0; i < runs.size(); ++i) {
    const mlperf::ResultRun& r = runs[i];
    html += fmt::format("<tr><td><span class=\"swatch\" style=\"background:{}\"></span>{}</td>", series_color(i),
                        html_escape(file_name(r)));
    html += html_num_cell(r.seed ? std::to_string(*r.seed) : kMissing);
    html += fmt::format("<td class=\"{}\">{}</td>", r.converged ? "status-ok" : "status-bad",
                        html_escape(mlperf::run_status(r)));
    html += html_num_cell(r.converged ? fmt::format("{:.4f}", r.minutes) : kMissing);
    html += html_num_cell(r.converged ? std::to_string(r.samples) : kMissing);
    html += html_num_cell(std::isnan(r.last_eval) ? kMissing : fmt::format("{:.4f}", r.last_eval));
    html += html_num_cell(tracked_mean(r.tracked_stats, &mlperf::TrackedStats::throughput, samples_per_s));
    html += html_num_cell(tracked_mean(r.tracked_stats, &mlperf::TrackedStats::tokens_per_s_per_gpu, grouped_number));
    html += html_num_cell(tracked_mean(r.tracked_stats, &mlperf::TrackedStats::tflops_per_gpu, tflops_number));
    html += "</tr>\n";
  }
  return html + "</table></div>\n<p class=\"note\">Minutes: run_stop \u2212 run_start. Samples to converge: the last "
                "eval_accuracy's samples_count before run_stop success. Samples/s, tokens/s/GPU and TFLOP/s/GPU: the "
                "means over the run's tracked_stats lines; - where none logs it.</p>\n";
}

std::string eval_chart(const MlperfReport& report) {
  Chart chart{"samples", "eval_accuracy", {}, {}};
  std::vector<std::string> names;
  for (size_t i = 0; i < report.runs.size(); ++i) {
    const mlperf::ResultRun& r = report.runs[i];
    names.push_back(file_name(r));
    ChartSeries line{names.back(), series_color(i), {}, false};
    for (const auto& e : r.evals) line.points.emplace_back(static_cast<double>(e.samples), e.value);
    ChartSeries dots = line;
    dots.dots = true;
    chart.series.push_back(std::move(line));
    chart.series.push_back(std::move(dots));
  }
  std::string caption = "eval_accuracy by samples_count";
  const auto known = mlperf::rcp_benchmark_names();
  if (std::find(known.begin(), known.end(), report.benchmark) != known.end()) {
    const double target = mlperf::rcp_benchmark(report.benchmark).target;
    chart.rules.push_back({target, fmt::format("target {:g}", target)});
    caption += fmt::format(" (dashed: the target, {:g})", target);
  }
  return html_legend(names) + html_figure(caption, chart);
}

}  // namespace

std::string render_mlperf_report(const MlperfReport& report, const std::string& generated_at) {
  const std::string heading = report.benchmark.empty() ? "MLPerf Training" : "MLPerf Training: " + report.benchmark;
  std::string html = html_page_open(heading + " (" + report.dir + ")");
  html += "<h1>" + html_escape(heading) + "</h1>\n";
  html += fmt::format("<p class=\"meta\">{} result file{} in {}", report.runs.size(), report.runs.size() == 1 ? "" : "s",
                      html_escape(report.dir));
  if (report.score) html += fmt::format(", global batch {}", report.score->global_batch);
  html += fmt::format(", generated {} by forge {}</p>\n", html_escape(generated_at), FORGE_VERSION);
  html += "<h2>Score</h2>\n" + summary(report);
  html += "<h2>Runs</h2>\n" + runs_table(report.runs);
  html += "<h2>Evaluations</h2>\n" + eval_chart(report);
  return html + html_page_close();
}

}  // namespace forge
