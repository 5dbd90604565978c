// Formatting the preflight report; see preflight_report.h. The text is built as rows of
// cells and padded per column, so long device names or error messages never misalign it.
#include "bench/preflight_report.h"

#include <algorithm>

#include <fmt/format.h>

#include "bench/preflight_reference.h"
#include "core/durable_file.h"

namespace forge {
namespace {

using Rows = std::vector<std::vector<std::string>>;

// Left-aligned columns two spaces apart; the last column is not padded.
std::string columns(const Rows& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], row[i].size());
    }
  }
  std::string text;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += i + 1 == row.size() ? row[i] : fmt::format("{:<{}}  ", row[i], width[i]);
    }
    line.erase(line.find_last_not_of(' ') + 1);
    text += line + "\n";
  }
  return text;
}

std::string or_unknown(const std::string& text) { return text.empty() ? "unknown" : text; }

// Three significant digits at least: "741", "52.3", "0.912".
std::string number(double value) {
  if (value >= 100) return fmt::format("{:.0f}", value);
  if (value >= 10) return fmt::format("{:.1f}", value);
  return fmt::format("{:.3g}", value);
}

std::optional<double> ratio(const PreflightCheck& check) {
  if (!check.value || !check.expected || *check.expected <= 0) return std::nullopt;
  return *check.value / *check.expected;
}

nlohmann::json optional_number(std::optional<double> value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

}  // namespace

std::string preflight_text(const PreflightReport& report) {
  const SystemInfo& s = report.system;
  std::string text = fmt::format(
      "forge preflight on {}: NVIDIA driver {}, CUDA driver {}, CUDA runtime {}, NCCL {}\n\n", or_unknown(s.host),
      or_unknown(s.driver_version), or_unknown(s.cuda_driver_version), or_unknown(s.cuda_runtime_version),
      or_unknown(s.nccl_version));

  Rows gpus = {{"GPU", "name", "memory", "compute", "max SM clock", "max memory clock", "ECC", "PCI bus"}};
  for (const GpuInfo& g : report.gpus) {
    gpus.push_back({std::to_string(g.index), g.name, fmt::format("{:.1f} GiB", g.memory_bytes / 1073741824.0),
                    fmt::format("{}.{}", g.compute_major, g.compute_minor), fmt::format("{} MHz", g.max_sm_clock_mhz),
                    fmt::format("{} MHz", g.max_memory_clock_mhz), g.ecc_enabled ? "on" : "off", g.pci_bus_id});
  }
  text += columns(gpus) + "\n";

  Rows checks = {{"check", "GPU", "measured", "expected", "ratio", "verdict"}};
  for (const PreflightCheck& c : report.checks) {
    const std::optional<double> r = ratio(c);
    std::string verdict = verdict_name(c.verdict);
    if (!c.detail.empty()) verdict += ": " + c.detail;
    checks.push_back({c.name, c.gpu < 0 ? "all" : std::to_string(c.gpu),
                      c.value ? fmt::format("{} {}", number(*c.value), c.unit) : "-",
                      c.expected ? fmt::format("{} {}", number(*c.expected), c.unit) : "-",
                      r ? fmt::format("{:.0f}%", 100 * *r) : "-", verdict});
  }
  text += columns(checks);

  auto count = [&](Verdict verdict) {
    return std::count_if(report.checks.begin(), report.checks.end(),
                         [&](const PreflightCheck& c) { return c.verdict == verdict; });
  };
  text += fmt::format("\nresult: {} ({} pass, {} warn, {} fail, {} no reference, {} skipped; pass >= {:.0f}% of the "
                      "reference, warn >= {:.0f}%)\n",
                      verdict_name(overall_verdict(report)), count(Verdict::Pass), count(Verdict::Warn),
                      count(Verdict::Fail), count(Verdict::NoReference), count(Verdict::Skipped),
                      100 * kPassFraction, 100 * kWarnFraction);
  return text;
}

nlohmann::json preflight_json(const PreflightReport& report) {
  const SystemInfo& s = report.system;
  nlohmann::json json = {
      {"system",
       {{"host", s.host},
        {"driver_version", s.driver_version},
        {"cuda_driver_version", s.cuda_driver_version},
        {"cuda_runtime_version", s.cuda_runtime_version},
        {"nccl_version", s.nccl_version}}},
      {"gpus", nlohmann::json::array()},
      {"checks", nlohmann::json::array()},
      {"verdict", verdict_name(overall_verdict(report))},
  };
  for (const GpuInfo& g : report.gpus) {
    json["gpus"].push_back({{"index", g.index},
                            {"name", g.name},
                            {"memory_bytes", g.memory_bytes},
                            {"compute_capability", fmt::format("{}.{}", g.compute_major, g.compute_minor)},
                            {"max_sm_clock_mhz", g.max_sm_clock_mhz},
                            {"max_memory_clock_mhz", g.max_memory_clock_mhz},
                            {"ecc_enabled", g.ecc_enabled},
                            {"pci_bus_id", g.pci_bus_id}});
  }
  for (const PreflightCheck& c : report.checks) {
    json["checks"].push_back({{"check", c.name},
                              {"gpu", c.gpu < 0 ? nlohmann::json(nullptr) : nlohmann::json(c.gpu)},
                              {"unit", c.unit},
                              {"value", optional_number(c.value)},
                              {"expected", optional_number(c.expected)},
                              {"ratio", optional_number(ratio(c))},
                              {"verdict", verdict_name(c.verdict)},
                              {"detail", c.detail}});
  }
  return json;
}

void write_preflight_json(const std::string& path, const PreflightReport& report) {
  write_file_atomic(path, preflight_json(report).dump(2) + "\n", {.sync = false});  // NOTE [Durable files]
}

}  // namespace forge
