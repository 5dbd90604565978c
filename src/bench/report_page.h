// The pieces forge's HTML pages are built from (`forge report`'s, bench/report_html.h,
// and `forge mlperf score --html`'s, bench/mlperf_report.h): one self-contained file,
// inline CSS and SVG, no script, nothing fetched; well-formed XML (every element closed,
// only numeric character references), every text from the files read escaped.
#pragma once

#include <cstddef>
#include <initializer_list>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "bench/report_chart.h"

namespace forge {

// Escapes & < > " ' for use in HTML text and attribute values.
std::string html_escape(std::string_view text);

// From <!DOCTYPE html> to <body>, with the pages' style sheet; `title` is escaped.
std::string html_page_open(const std::string& title);
// </body></html>.
std::string html_page_close();

// The color of the `index`th series, one per run: distinguishable on white and for the
// common color-vision deficiencies first.
std::string series_color(size_t index);

// A table row of header cells, (name, numeric); names are HTML already.
std::string html_header_row(std::initializer_list<std::pair<const char*, bool>> columns);
// A <td> of escaped text, left-aligned or, for numbers, right-aligned.
std::string html_cell(const std::string& text);
std::string html_num_cell(const std::string& text);

// A swatch of each run's color (series_color) and its name, as above a set of charts.
std::string html_legend(const std::vector<std::string>& names);
// A chart with its caption.
std::string html_figure(const std::string& caption, const Chart& chart);

// 12345.6 as "12,346"; a TFLOP/s figure with 3 decimals below 10, else 1.
std::string grouped_number(double value);
std::string tflops_number(double value);

// "2025-06-01 12:00 UTC": when a page was generated, for its header.
std::string utc_timestamp();

}  // namespace forge
