// The shared pieces of forge's HTML pages: bench/report_page.h.
#include "bench/report_page.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <ctime>
#include <iterator>

namespace forge {
namespace {

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
svg.chart .target { stroke: #374151; stroke-width: 1.2; stroke-dasharray: 6 4; }
.status-bad { color: #b91c1c; }
.error { color: #6b7280; font-size: 11px; }
)";

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

std::string html_page_open(const std::string& title) {
  return "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\"/>\n"
         "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\"/>\n<title>" +
         html_escape(title) + "</title>\n<style>" + kStyle + "</style>\n</head>\n<body>\n";
}

std::string html_page_close() { return "</body>\n</html>\n"; }

std::string series_color(size_t index) { return kPalette[index % std::size(kPalette)]; }

std::string html_header_row(std::initializer_list<std::pair<const char*, bool>> columns) {
  std::string row = "<tr>";
  for (const auto& [name, numeric] : columns) row += fmt::format("<th{}>{}</th>", numeric ? " class=\"num\"" : "", name);
  return row + "</tr>\n";
}

std::string html_cell(const std::string& text) { return "<td>" + html_escape(text) + "</td>"; }
std::string html_num_cell(const std::string& text) { return "<td class=\"num\">" + html_escape(text) + "</td>"; }

std::string html_legend(const std::vector<std::string>& names) {
  std::string html = "<div class=\"legend\">";
  for (size_t i = 0; i < names.size(); ++i)
    html += fmt::format("<span><i class=\"swatch\" style=\"background:{}\"></i>{}</span>", series_color(i),
                        html_escape(names[i]));
  return html + "</div>\n";
}

std::string html_figure(const std::string& caption, const Chart& chart) {
  return "<figure><figcaption>" + html_escape(caption) + "</figcaption>\n" + chart_svg(chart) + "</figure>\n";
}

std::string grouped_number(double value) {
  const std::string digits = fmt::format("{:.0f}", std::abs(value));
  std::string out = value < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::string tflops_number(double v) { return v < 10 ? fmt::format("{:.3f}", v) : fmt::format("{:.1f}", v); }

std::string utc_timestamp() {
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  std::tm utc{};
  gmtime_r(&now, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y-%m-%d %H:%M UTC", &utc);
  return stamp;
}

}  // namespace forge
