#include "bench/report_chart.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "bench/report_html.h"

namespace forge {
namespace {

// The drawing, in viewBox units; the plot area is inside the margins.
constexpr double kWidth = 640, kHeight = 300;
constexpr double kLeft = 62, kRight = 18, kTop = 14, kBottom = 46;
constexpr int kXTicks = 6, kYTicks = 5;

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
};

// The tick step for a span: 1, 2 or 5 times a power of ten, at least min_step.
double nice_step(double span, int target, double min_step) {
  const double raw = span / std::max(target, 1);
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double fraction = raw / magnitude;
  const double step = (fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10) * magnitude;
  return std::max(step, min_step);
}

std::vector<double> ticks_with_min_step(double lo, double hi, int target, double min_step) {
  if (!(hi > lo)) {  // one value: a span around it
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double step = nice_step(hi - lo, target, min_step);
  const double first = std::floor(lo / step + 1e-9) * step;
  const double last = std::ceil(hi / step - 1e-9) * step;
  std::vector<double> ticks;
  const auto count = static_cast<int64_t>(std::llround((last - first) / step));
  for (int64_t i = 0; i <= count; ++i) {
    const double t = first + static_cast<double>(i) * step;
    ticks.push_back(std::abs(t) < step * 1e-9 ? 0.0 : t);
  }
  return ticks;
}

std::string number(double v) { return fmt::format("{:.1f}", v); }

}  // namespace

std::vector<double> nice_ticks(double lo, double hi, int target) { return ticks_with_min_step(lo, hi, target, 0.0); }

std::string format_tick(double value) {
  const double a = std::abs(value);
  if (a >= 1e9) return fmt::format("{:g}G", value / 1e9);
  if (a >= 1e6) return fmt::format("{:g}M", value / 1e6);
  if (a >= 1e3) return fmt::format("{:g}k", value / 1e3);
  return fmt::format("{:g}", value);
}

std::string chart_svg(const Chart& chart) {
  Range xs, ys;
  for (const auto& s : chart.series)
    for (const auto& [x, y] : s.points)
      if (std::isfinite(x) && std::isfinite(y)) {
        xs.add(x);
        ys.add(y);
      }
  if (xs.empty()) {
    xs.add(0);
    xs.add(1);
    ys.add(0);
    ys.add(1);
  }
  // Steps are whole numbers: x ticks never fall between two.
  const std::vector<double> x_ticks = ticks_with_min_step(xs.lo, xs.hi, kXTicks, 1.0);
  const std::vector<double> y_ticks = nice_ticks(ys.lo, ys.hi, kYTicks);
  const double x0 = x_ticks.front(), x1 = x_ticks.back(), y0 = y_ticks.front(), y1 = y_ticks.back();
  const double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - x0) / (x1 - x0) * plot_w; };
  auto py = [&](double y) { return kTop + (1.0 - (y - y0) / (y1 - y0)) * plot_h; };

  std::string svg = fmt::format(
      "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {} {}\" role=\"img\" "
      "aria-label=\"{} by {}\">\n",
      kWidth, kHeight, html_escape(chart.y_label), html_escape(chart.x_label));
  for (double t : y_ticks) {
    const std::string y = number(py(t));
    svg += fmt::format("<line class=\"grid\" x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>", number(kLeft), y,
                       number(kWidth - kRight), y);
    svg += fmt::format("<text class=\"tick\" x=\"{}\" y=\"{}\" text-anchor=\"end\" dominant-baseline=\"middle\">{}</text>\n",
                       number(kLeft - 6), y, html_escape(format_tick(t)));
  }
  for (double t : x_ticks) {
    const std::string x = number(px(t));
    svg += fmt::format("<line class=\"grid\" x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>", x, number(kTop), x,
                       number(kHeight - kBottom));
    svg += fmt::format("<text class=\"tick\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x,
                       number(kHeight - kBottom + 16), html_escape(format_tick(t)));
  }
  svg += fmt::format("<rect class=\"frame\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\"/>\n", number(kLeft),
                     number(kTop), number(plot_w), number(plot_h));
  svg += fmt::format("<text class=\"label\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                     number(kLeft + plot_w / 2), number(kHeight - 8), html_escape(chart.x_label));
  svg += fmt::format(
      "<text class=\"label\" x=\"14\" y=\"{}\" text-anchor=\"middle\" transform=\"rotate(-90 14 {})\">{}</text>\n",
      number(kTop + plot_h / 2), number(kTop + plot_h / 2), html_escape(chart.y_label));

  for (const auto& s : chart.series) {
    std::vector<std::pair<double, double>> finite;
    for (const auto& p : s.points)
      if (std::isfinite(p.first) && std::isfinite(p.second)) finite.push_back(p);
    if (finite.empty()) continue;
    if (s.dots || finite.size() == 1) {
      for (const auto& [x, y] : finite)
        svg += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3.5\" fill=\"{}\"><title>{}: step {:g}, {:g}</title></circle>\n",
                           number(px(x)), number(py(y)), s.color, html_escape(s.name), x, y);
      continue;
    }
    svg += fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.6\" stroke-linejoin=\"round\" points=\"",
                       s.color);
    for (const auto& [x, y] : finite) svg += number(px(x)) + "," + number(py(y)) + " ";
    svg.back() = '"';
    svg += "/>\n";
  }
  svg += "</svg>\n";
  return svg;
}

}  // namespace forge
