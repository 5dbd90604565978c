#include "bench/report_html.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>

#include "bench/median.h"
#include "bench/report_chart.h"
#include "bench/report_page.h"

namespace forge {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr const char* kNotAvailable = "n/a";

template <typename Get>
std::optional<double> median_of(const std::vector<StepMetrics>& steps, Get get) {
  std::vector<double> values;
  for (const auto& m : steps)
    if (const std::optional<double> v = get(m)) values.push_back(*v);
  return median(values);
}

std::string count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f} M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f} K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string percent(double fraction) { return fmt::format("{:.1f}%", fraction * 100); }
std::string seconds(double s) { return s < 1 ? fmt::format("{:.1f} ms", s * 1e3) : fmt::format("{:.2f} s", s); }
std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / kGiB); }

template <typename Format>
std::string or_na(const std::optional<double>& v, Format format) {
  return v ? format(*v) : kNotAvailable;
}

std::string run_label(const ReportRun& run, size_t index) {
  std::string label = fmt::format("<span class=\"swatch\" style=\"background:{}\"></span>{}", series_color(index),
                                  html_escape(run.name));
  if (run.name != run.dir) label += "<div class=\"path\">" + html_escape(run.dir) + "</div>";
  return label;
}

// "8 × 128" (sequences × tokens per step), with the micro-batch and accumulation when a
// step accumulates several micro-batches.
std::string batch_cell(const ReportRun& run) {
  if (!run.global_batch || !run.seq_len) return html_num_cell(kNotAvailable);
  std::string html = fmt::format("<td class=\"num\">{} \u00d7 {}", *run.global_batch, *run.seq_len);
  if (run.micro_batch && run.grad_accum && *run.grad_accum > 1)
    html += fmt::format("<div class=\"sub\">{} micro \u00d7 {} accum</div>", *run.micro_batch, *run.grad_accum);
  return html + "</td>";
}

std::string runs_table(const std::vector<ReportRun>& runs) {
  std::string html = "<div class=\"scroll\"><table class=\"runs\">\n";
  html += html_header_row({{"Run", false}, {"Model", false}, {"Device", false}, {"Parameters", true},
                           {"Batch \u00d7 seq", true}, {"Steps", true}, {"Final loss", true}, {"Final eval loss", true},
                           {"Tokens/s", true}, {"TFLOP/s", true}, {"MFU", true}, {"Step time", true},
                           {"Peak memory", true}});
  for (size_t i = 0; i < runs.size(); ++i) {
    const ReportRun& r = runs[i];
    const auto tok = median_of(r.steps, [](const StepMetrics& m) { return std::optional<double>(m.tokens_per_s); });
    const auto tf = median_of(r.steps, [](const StepMetrics& m) { return std::optional<double>(m.model_tflops); });
    const auto mfu = median_of(r.steps, [](const StepMetrics& m) { return m.mfu; });
    const auto mfu_fp8 = median_of(r.steps, [](const StepMetrics& m) { return m.mfu_fp8; });
    const auto step_time = median_of(r.steps, [](const StepMetrics& m) { return std::optional<double>(m.step_time_s); });
    std::optional<double> peak;
    for (const auto& m : r.steps)
      if (m.peak_memory_bytes) peak = std::max(peak.value_or(0.0), static_cast<double>(*m.peak_memory_bytes));
    std::string model = "<td>" + html_escape(r.model);
    if (!r.precision.empty()) model += "<div class=\"sub\">" + html_escape(r.precision) + "</div>";
    html += "<tr><td>" + run_label(r, i) + "</td>" + model + "</td>" + html_cell(r.device.empty() ? kNotAvailable : r.device) +
            html_num_cell(count(static_cast<double>(r.parameters))) + batch_cell(r) +
            html_num_cell(r.steps.empty() ? "0" : std::to_string(r.steps.back().step)) +
            html_num_cell(r.steps.empty() ? kNotAvailable : fmt::format("{:.4f}", r.steps.back().loss)) +
            html_num_cell(r.evals.empty() ? kNotAvailable : fmt::format("{:.4f}", r.evals.back().loss)) +
            html_num_cell(or_na(tok, grouped_number)) + html_num_cell(or_na(tf, tflops_number)) +
            "<td class=\"num\">" + html_escape(or_na(mfu, percent)) +
            (mfu_fp8 ? "<div class=\"sub\">FP8 peak " + html_escape(percent(*mfu_fp8)) + "</div>" : std::string()) +
            "</td>" + html_num_cell(or_na(step_time, seconds)) + html_num_cell(or_na(peak, gib)) + "</tr>\n";
  }
  return html + "</table></div>\n<p class=\"note\">Tokens/s (all devices), model TFLOP/s (per device), MFU and "
                "step time are medians over the run's steps; peak memory is the highest of any step.</p>\n";
}

// MFU against the bf16 peak, and for an FP8 run against the fp8 peak beneath it.
std::string mfu_cell(const BenchResult& b) {
  const bool ok = b.status == "ok";
  std::string html = "<td class=\"num\">" + html_escape(ok && b.mfu ? percent(*b.mfu) : std::string(kNotAvailable));
  if (ok && !b.fp8.empty() && b.fp8 != "none")
    html += "<div class=\"sub\">FP8 peak " + html_escape(b.mfu_fp8 ? percent(*b.mfu_fp8) : std::string(kNotAvailable)) +
            "</div>";
  return html + "</td>";
}

std::string bench_table(const std::vector<BenchResult>& results) {
  std::string html = "<div class=\"scroll\"><table class=\"bench\">\n";
  html += html_header_row({{"Model", false}, {"Precision", false}, {"Parallelism", false}, {"GPUs", true},
                           {"Micro-batch", true}, {"Seq len", true}, {"Accum", true}, {"Global batch", true},
                           {"Act. ckpt", false}, {"Step time", true}, {"Tokens/s/GPU", true}, {"TFLOP/s/GPU", true},
                           {"MFU", true}, {"Peak memory", true}, {"Status", false}});
  auto positive = [](int64_t v) { return v > 0 ? std::to_string(v) : std::string(kNotAvailable); };
  auto text = [](const std::string& s) { return s.empty() ? std::string(kNotAvailable) : s; };
  for (const BenchResult& b : results) {
    const bool ok = b.status == "ok";
    auto measured = [&](double v, auto format) { return ok && v > 0 ? format(v) : std::string(kNotAvailable); };
    std::string status = fmt::format("<td class=\"{}\">{}", ok ? "status-ok" : "status-bad", html_escape(b.status));
    if (!b.error.empty()) status += "<div class=\"error\">" + html_escape(b.error) + "</div>";
    html += "<tr>" + html_cell(b.model) + html_cell(b.fp8.empty() || b.fp8 == "none" ? text(b.precision) : precision_label(b)) + html_cell(text(b.parallelism)) + html_num_cell(positive(b.n_gpus)) +
            html_num_cell(positive(b.micro_batch)) + html_num_cell(positive(b.seq_len)) + html_num_cell(positive(b.grad_accum)) +
            html_num_cell(positive(b.global_batch)) + html_cell(text(b.activation_checkpoint)) +
            html_num_cell(measured(b.step_time_median_s, seconds)) + html_num_cell(measured(b.tokens_per_s_per_gpu, grouped_number)) +
            html_num_cell(measured(b.tflops_per_gpu, tflops_number)) +
            mfu_cell(b) +
            html_num_cell(measured(static_cast<double>(b.peak_memory_bytes), gib)) + status + "</td></tr>\n";
  }
  return html + "</table></div>\n";
}

template <typename Get>
Chart step_chart(const std::vector<ReportRun>& runs, const std::string& y_label, Get get) {
  Chart chart{"step", y_label, {}, {}};
  for (size_t i = 0; i < runs.size(); ++i) {
    ChartSeries s{runs[i].name, series_color(i), {}, false};
    for (const auto& m : runs[i].steps)
      if (const std::optional<double> v = get(m)) s.points.emplace_back(static_cast<double>(m.step), *v);
    chart.series.push_back(std::move(s));
  }
  return chart;
}

std::string charts(const std::vector<ReportRun>& runs) {
  std::vector<std::string> names;
  for (const auto& r : runs) names.push_back(r.name);
  std::string html = html_legend(names) + "<div class=\"charts\">\n";

  Chart loss = step_chart(runs, "loss", [](const StepMetrics& m) { return std::optional<double>(m.loss); });
  for (size_t i = 0; i < runs.size(); ++i) {
    ChartSeries evals{runs[i].name + " (validation)", series_color(i), {}, true};
    for (const auto& e : runs[i].evals) evals.points.emplace_back(static_cast<double>(e.step), e.loss);
    loss.series.push_back(std::move(evals));
  }
  html += html_figure("Loss (lines: training, dots: validation)", loss);
  html += html_figure("Tokens per second",
                 step_chart(runs, "tokens/s", [](const StepMetrics& m) { return std::optional<double>(m.tokens_per_s); }));
  html += html_figure("Model TFLOP/s per device", step_chart(runs, "TFLOP/s", [](const StepMetrics& m) {
                   return std::optional<double>(m.model_tflops);
                 }));
  const bool any_memory = std::any_of(runs.begin(), runs.end(), [](const ReportRun& r) {
    return std::any_of(r.steps.begin(), r.steps.end(), [](const StepMetrics& m) { return m.peak_memory_bytes.has_value(); });
  });
  if (any_memory)
    html += html_figure("Peak device memory", step_chart(runs, "GiB", [](const StepMetrics& m) {
                     return m.peak_memory_bytes ? std::optional<double>(static_cast<double>(*m.peak_memory_bytes) / kGiB)
                                                : std::nullopt;
                   }));
  return html + "</div>\n";
}

}  // namespace

std::string render_report(const std::vector<ReportRun>& runs, const std::string& generated_at) {
  std::vector<std::string> names;
  for (const auto& r : runs) names.push_back(r.name);
  std::string html = html_page_open("forge report: " + fmt::format("{}", fmt::join(names, ", ")));
  html += fmt::format("<h1>forge report</h1>\n<p class=\"meta\">{} run{}, generated {} by forge {}</p>\n", runs.size(),
                      runs.size() == 1 ? "" : "s", html_escape(generated_at), FORGE_VERSION);
  std::vector<ReportRun> trained;
  std::copy_if(runs.begin(), runs.end(), std::back_inserter(trained), [](const ReportRun& r) { return r.has_metrics; });
  if (!trained.empty()) {
    html += "<h2>Runs</h2>\n" + runs_table(trained);
    html += "<h2>Training curves</h2>\n" + charts(trained);
  }
  for (const auto& r : runs)
    if (!r.bench.empty()) html += "<h2>Benchmark: " + html_escape(r.name) + "</h2>\n" + bench_table(r.bench);
  return html + html_page_close();
}

}  // namespace forge
