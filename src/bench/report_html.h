// The page `forge report` writes: one self-contained HTML file (inline CSS and SVG, no
// script, nothing fetched) comparing runs side by side:
//
//   a table of the training runs (directories with metrics.jsonl): model, device, parameters, batch, sequence length, final
//     training and validation loss, and the medians over steps of tokens/s, model
//     TFLOP/s, MFU and step time (medians, so warm-up steps do not skew them), peak memory
//   charts over steps, one color per run: loss (lines: training, dots: validation),
//     tokens/s, model TFLOP/s per device, and peak memory when a run measured it
//   per directory with a bench.json, its benchmark table
//
// Built from bench/report_page.h's pieces: well-formed XML, every text from the files read
// (names, paths, device and model names, errors) escaped.
#pragma once

#include <string>
#include <vector>

#include "bench/report_data.h"

namespace forge {

// `generated_at` is printed in the page's header (e.g. "2025-06-01 12:00 UTC").
std::string render_report(const std::vector<ReportRun>& runs, const std::string& generated_at);

}  // namespace forge
