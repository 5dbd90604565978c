// Line charts as inline SVG for forge's HTML pages (bench/report_page.h): no script, no external file, so the page
// renders anywhere, offline, and prints. One chart is an x/y plot of several series, each
// a polyline (training curves) or a set of dots (evaluations), over axes with "nice"
// ticks (1, 2 or 5 times a power of ten) and light grid lines. Each point carries a
// <title>, the tooltip a browser shows on hover, only for dot series: a polyline of
// thousands of steps stays one element.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace forge {

struct ChartSeries {
  std::string name;   // shown in dot tooltips
  std::string color;  // CSS color
  std::vector<std::pair<double, double>> points;  // (x, y), x ascending
  bool dots = false;  // dots instead of a line (a line of one point is drawn as a dot)
};

// A horizontal line across the plot, such as a target, labelled at its right end.
struct ChartRule {
  double y = 0;
  std::string label;
};

struct Chart {
  std::string x_label;  // also names x in dot tooltips ("step 10")
  std::string y_label;
  std::vector<ChartSeries> series;
  std::vector<ChartRule> rules;  // the y range includes them
};

// An <svg> element, scaled to its container's width.
std::string chart_svg(const Chart& chart);

// About `target` round tick values spanning [lo, hi]: the first <= lo, the last >= hi.
std::vector<double> nice_ticks(double lo, double hi, int target);
// A tick label: "0.5", "250", "12k", "1.5M", "2G".
std::string format_tick(double value);

}  // namespace forge
