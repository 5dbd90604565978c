// The preflight report for people (aligned text: the system, a line per GPU, a line per
// check, the overall verdict last) and for programs (JSON with the same content).
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "bench/preflight.h"

namespace forge {

std::string preflight_text(const PreflightReport& report);

// {"system": {...}, "gpus": [{...}], "checks": [{"check", "gpu" (null: all GPUs), "unit",
// "value", "expected", "ratio" (value / expected), "verdict", "detail"}], "verdict"};
// numbers that are unknown are null.
nlohmann::json preflight_json(const PreflightReport& report);

// preflight_json, written to a temporary file beside `path` and renamed over it.
void write_preflight_json(const std::string& path, const PreflightReport& report);

}  // namespace forge
