// forge preflight: runs the system checks (bench/preflight.h), prints the report, writes
// it as JSON when asked, and fails the process when any check failed, so a job script can
// stop before training on a broken node.
#include <fmt/format.h>

#include "bench/preflight.h"
#include "bench/preflight_report.h"
#include "cli/commands.h"
#include "core/log.h"

namespace forge {

int run_preflight(const std::string& json_path) {
  const PreflightReport report = run_preflight_checks();
  fmt::print("{}", preflight_text(report));
  if (!json_path.empty()) {
    write_preflight_json(json_path, report);
    log_info("preflight: wrote {}", json_path);
  }
  return overall_verdict(report) == Verdict::Fail ? 1 : 0;
}

}  // namespace forge
