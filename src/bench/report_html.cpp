#include "bench/report_html.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <optional>

#include "bench/median.h"
#include "bench/report_chart.h"

namespace forge {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr const char* kNotAvailable = "n/a";

// Distinguishable on white and for the common color-vision deficiencies first.
constexpr const char* kPalette[] = {"#1f77b4", "#e8710a", "#2ca02c", "#d62728", "#9467bd",
                                    "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

constexpr const char* kStyle = R"(
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1f2937; margin: 24px auto;
       max-width: 1360px; padding: 0 16px; line-height: 1.4; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 28px 0 10px; border-bottom: 1px solid #e5e7eb; padding-bottom: 4px; }
.meta { color: #6b7280; font-size: 13px; margin: 0; }
table { border-collapse: collapse; font-size: 13px; width: 100%; }
th, td { border: 1px solid #e5e7eb; padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #f9fafb; font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
td.num { white-space: nowrap; }
.scroll { overflow-x: auto; }
.note { color: #6b7280; font-size: 12px; margin: 6px 0 0; }
.sub, .path { color: #6b7280; font-size: 11px; }
.path { overflow-wrap: anywhere; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 6px;
          vertical-align: -1px; }
.legend { font-size: 13px; margin: 0 0 8px; }
.legend span { margin-right: 18px; white-space: nowrap; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 16px; }
figure { margin: 0; border: 1px solid #e5e7eb; border-radius: 6px; padding: 8px 8px 2px; }
figcaption { font-size: 14px; font-weight: 600; margin: 0 0 2px 6px; }
svg.chart { width: 100%; height: auto; display: block; }
svg.chart .grid { stroke: #eef0f3; stroke-width: 1; }
svg.chart .frame { fill: none; stroke: #9ca3af; stroke-width: 1; }
svg.chart .tick { font-size: 11px; fill: #4b5563; }
svg.chart .label { font-size: 12px; fill: #374151; }
.status-bad { color: #b91c1c; }
.error { color: #6b7280; font-size: 11px; }
)";

std::string color_of(size_t run) { return kPalette[run % std::size(kPalette)]; }

template <typename Get>
std::optional<double> median_of(const std::vector<StepMetrics>& steps, Get get) {
  std::vector<double> values;
  for (const auto& m : steps)
    if (const std::optional<double> v = get(m)) values.push_back(*v);
  return median(values);
}

std::string grouped(double value) {
  const std::string digits = fmt::format("{:.0f}", std::abs(value));
  std::string out = value < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string count(double n) {
  if (n >= 1e9) return fmt::format("{:.2f} B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f} M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f} K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string tflops(double v) { return v < 10 ? fmt::format("{:.3f}", v) : fmt::format("{:.1f}", v); }
std::string percent(double fraction) { return fmt::format("{:.1f}%", fraction * 100); }
std::string seconds(double s) { return s < 1 ? fmt::format("{:.1f} ms", s * 1e3) : fmt::format("{:.2f} s", s); }
std::string gib(double bytes) { return fmt::format("{:.2f} GiB", bytes / kGiB); }

template <typename Format>
std::string or_na(const std::optional<double>& v, Format format) {
  return v ? format(*v) : kNotAvailable;
}

std::string cell(const std::string& text) { return "<td>" + html_escape(text) + "</td>"; }
std::string num_cell(const std::string& text) { return "<td class=\"num\">" + html_escape(text) + "</td>"; }

std::string header_row(std::initializer_list<std::pair<const char*, bool>> columns) {
  std::string row = "<tr>";
  for (const auto& [name, numeric] : columns) row += fmt::format("<th{}>{}</th>", numeric ? " class=\"num\"" : "", name);
  return row + "</tr>\n";
}

std::string run_label(const ReportRun& run, size_t index) {
  std::string label = fmt::format("<span class=\"swatch\" style=\"background:{}\"></span>{}", color_of(index),
                                  html_escape(run.name));
  if (run.name != run.dir) label += "<div class=\"path\">" + html_escape(run.dir) + "</div>";
  return label;
}

// "8 × 128" (sequences × tokens per step), with the micro-batch and accumulation when a
// step accumulates several micro-batches.
std::string batch_cell(const ReportRun& run) {
  if (!run.global_batch || !run.seq_len) return num_cell(kNotAvailable);
  std::string html = fmt::format("<td class=\"num\">{} \u00d7 {}", *run.global_batch, *run.seq_len);
  if (run.micro_batch && run.grad_accum && *run.grad_accum > 1)
    html += fmt::format("<div class=\"sub\">{} micro \u00d7 {} accum</div>", *run.micro_batch, *run.grad_accum);
  return html + "</td>";
}

std::string runs_table(const std::vector<ReportRun>& runs) {
  std::string html = "<div class=\"scroll\"><table class=\"runs\">\n";
  html += header_row({{"Run", false}, {"Model", false}, {"Device", false}, {"Parameters", true},
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
    html += "<tr><td>" + run_label(r, i) + "</td>" + model + "</td>" + cell(r.device.empty() ? kNotAvailable : r.device) +
            num_cell(count(static_cast<double>(r.parameters))) + batch_cell(r) +
            num_cell(r.steps.empty() ? "0" : std::to_string(r.steps.back().step)) +
            num_cell(r.steps.empty() ? kNotAvailable : fmt::format("{:.4f}", r.steps.back().loss)) +
            num_cell(r.evals.empty() ? kNotAvailable : fmt::format("{:.4f}", r.evals.back().loss)) +
            num_cell(or_na(tok, grouped)) + num_cell(or_na(tf, tflops)) +
            "<td class=\"num\">" + html_escape(or_na(mfu, percent)) +
            (mfu_fp8 ? "<div class=\"sub\">FP8 peak " + html_escape(percent(*mfu_fp8)) + "</div>" : std::string()) +
            "</td>" + num_cell(or_na(step_time, seconds)) + num_cell(or_na(peak, gib)) + "</tr>\n";
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
  html += header_row({{"Model", false}, {"Precision", false}, {"Parallelism", false}, {"GPUs", true},
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
    html += "<tr>" + cell(b.model) + cell(b.fp8.empty() || b.fp8 == "none" ? text(b.precision) : precision_label(b)) + cell(text(b.parallelism)) + num_cell(positive(b.n_gpus)) +
            num_cell(positive(b.micro_batch)) + num_cell(positive(b.seq_len)) + num_cell(positive(b.grad_accum)) +
            num_cell(positive(b.global_batch)) + cell(text(b.activation_checkpoint)) +
            num_cell(measured(b.step_time_median_s, seconds)) + num_cell(measured(b.tokens_per_s_per_gpu, grouped)) +
            num_cell(measured(b.tflops_per_gpu, tflops)) +
            mfu_cell(b) +
            num_cell(measured(static_cast<double>(b.peak_memory_bytes), gib)) + status + "</td></tr>\n";
  }
  return html + "</table></div>\n";
}

template <typename Get>
Chart step_chart(const std::vector<ReportRun>& runs, const std::string& y_label, Get get) {
  Chart chart{"step", y_label, {}};
  for (size_t i = 0; i < runs.size(); ++i) {
    ChartSeries s{runs[i].name, color_of(i), {}, false};
    for (const auto& m : runs[i].steps)
      if (const std::optional<double> v = get(m)) s.points.emplace_back(static_cast<double>(m.step), *v);
    chart.series.push_back(std::move(s));
  }
  return chart;
}

std::string figure(const std::string& caption, const Chart& chart) {
  return "<figure><figcaption>" + html_escape(caption) + "</figcaption>\n" + chart_svg(chart) + "</figure>\n";
}

std::string charts(const std::vector<ReportRun>& runs) {
  std::string html = "<div class=\"legend\">";
  for (size_t i = 0; i < runs.size(); ++i)
    html += fmt::format("<span><i class=\"swatch\" style=\"background:{}\"></i>{}</span>", color_of(i),
                        html_escape(runs[i].name));
  html += "</div>\n<div class=\"charts\">\n";

  Chart loss = step_chart(runs, "loss", [](const StepMetrics& m) { return std::optional<double>(m.loss); });
  for (size_t i = 0; i < runs.size(); ++i) {
    ChartSeries evals{runs[i].name + " (validation)", color_of(i), {}, true};
    for (const auto& e : runs[i].evals) evals.points.emplace_back(static_cast<double>(e.step), e.loss);
    loss.series.push_back(std::move(evals));
  }
  html += figure("Loss (lines: training, dots: validation)", loss);
  html += figure("Tokens per second",
                 step_chart(runs, "tokens/s", [](const StepMetrics& m) { return std::optional<double>(m.tokens_per_s); }));
  html += figure("Model TFLOP/s per device", step_chart(runs, "TFLOP/s", [](const StepMetrics& m) {
                   return std::optional<double>(m.model_tflops);
                 }));
  const bool any_memory = std::any_of(runs.begin(), runs.end(), [](const ReportRun& r) {
    return std::any_of(r.steps.begin(), r.steps.end(), [](const StepMetrics& m) { return m.peak_memory_bytes.has_value(); });
  });
  if (any_memory)
    html += figure("Peak device memory", step_chart(runs, "GiB", [](const StepMetrics& m) {
                     return m.peak_memory_bytes ? std::optional<double>(static_cast<double>(*m.peak_memory_bytes) / kGiB)
                                                : std::nullopt;
                   }));
  return html + "</div>\n";
}

}  // namespace

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string render_report(const std::vector<ReportRun>& runs, const std::string& generated_at) {
  std::vector<std::string> names;
  for (const auto& r : runs) names.push_back(r.name);
  std::string html = "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
                     "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>\n";
  html += "<title>forge report: " + html_escape(fmt::format("{}", fmt::join(names, ", "))) + "</title>\n";
  html += std::string("<style>") + kStyle + "</style>\n</head>\n<body>\n";
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
  return html + "</body>\n</html>\n";
}

}  // namespace forge
