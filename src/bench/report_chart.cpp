#include "bench/report_chart.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "bench/report_page.h"

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

// NOTE [Charts of extreme values]
// A diverged run logs losses up to ±1e308, whose span overflows to infinity. The chart
// works with half-spans (finite for any two finite values), and when the "nice" ticks
// would leave the finite doubles or be absurdly many it falls back to the data's own
// ends as its two ticks: an ugly axis, never a crash or an endless loop.

// The tick step for a span given as its half: 1, 2 or 5 times a power of ten, at least
// min_step.
double nice_step(double half_span, int target, double min_step) {
  const double raw = half_span / std::max(target, 1) * 2;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double fraction = raw / magnitude;
  const double step = (fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10) * magnitude;
  return std::max(step, min_step);
}

std::vector<double> ticks_with_min_step(double lo, double hi, int target, double min_step) {
  if (!(hi > lo)) {  // one value: a span around it, on the side that stays finite
    const double pad = lo == 0 ? 1.0 : std::abs(lo) * 0.1;
    if (std::isfinite(lo - pad) && std::isfinite(hi + pad)) {
      lo -= pad;
      hi += pad;
    } else if (lo > 0) {
      lo -= pad;
    } else {
      hi += pad;
    }
  }
  constexpr double kMaxTicks = 1000;
  const double step = nice_step(hi / 2 - lo / 2, target, min_step);
  const double first = std::floor(lo / step + 1e-9) * step;
  const double last = std::ceil(hi / step - 1e-9) * step;
  const double steps = (last / 2 - first / 2) / step * 2;
  if (!std::isfinite(first) || !std::isfinite(last) || !(step > 0) || !(steps >= 0 && steps <= kMaxTicks))
    return {lo, hi};  // NOTE [Charts of extreme values]
  std::vector<double> ticks;
  const auto count = static_cast<int64_t>(std::llround(steps));
  for (int64_t i = 0; i <= count; ++i) {
    const double t = (first / 2 + static_cast<double>(i) * (step / 2)) * 2;  // i × step alone may overflow
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
  for (const auto& rule : chart.rules)
    if (std::isfinite(rule.y)) ys.add(rule.y);
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
  // Fractions of the axis from halves, as the span itself may overflow (NOTE [Charts of extreme values]).
  auto fraction = [](double v, double lo, double hi) { return (v / 2 - lo / 2) / (hi / 2 - lo / 2); };
  auto px = [&](double x) { return kLeft + fraction(x, x0, x1) * plot_w; };
  auto py = [&](double y) { return kTop + (1.0 - fraction(y, y0, y1)) * plot_h; };

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

  for (const auto& rule : chart.rules) {
    if (!std::isfinite(rule.y)) continue;
    const std::string y = number(py(rule.y));
    svg += fmt::format("<line class=\"target\" x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\"/>", number(kLeft), y,
                       number(kWidth - kRight), y);
    svg += fmt::format("<text class=\"tick\" x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
                       number(kWidth - kRight - 4), number(py(rule.y) - 4), html_escape(rule.label));
  }
  for (const auto& s : chart.series) {
    std::vector<std::pair<double, double>> finite;
    for (const auto& p : s.points)
      if (std::isfinite(p.first) && std::isfinite(p.second)) finite.push_back(p);
    if (finite.empty()) continue;
    if (s.dots || finite.size() == 1) {
      for (const auto& [x, y] : finite)
        svg += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"3.5\" fill=\"{}\"><title>{}: {} {:g}, {:g}</title></circle>\n",
                           number(px(x)), number(py(y)), s.color, html_escape(s.name), html_escape(chart.x_label), x, y);
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
