// forge report RUN_DIR [RUN_DIR ...] [--output FILE.html]: reads every run directory
// (bench/report_data.h), renders the page (bench/report_html.h) and writes it atomically.
// All reading and checking happens first, so a bad run directory leaves no output file,
// and an existing report is replaced only by a complete one.
#include <filesystem>
#include <map>

#include "bench/report_html.h"
#include "bench/report_page.h"
#include "cli/commands.h"
#include "core/durable_file.h"
#include "core/error.h"
#include "core/log.h"

namespace forge {
namespace {

// Runs are labelled by their directory's name, or by the path as given where two names
// would be the same.
void name_runs(std::vector<ReportRun>& runs) {
  std::map<std::string, int> uses;
  auto base = [](const std::string& dir) {
    const std::filesystem::path p = std::filesystem::path(dir).lexically_normal();
    return (p.has_filename() ? p.filename() : p.parent_path().filename()).string();
  };
  for (const auto& r : runs) ++uses[base(r.dir)];
  for (auto& r : runs) r.name = uses[base(r.dir)] == 1 && !base(r.dir).empty() ? base(r.dir) : r.dir;
}

}  // namespace

int run_report(const std::vector<std::string>& run_dirs, const std::string& output) {
  if (run_dirs.empty()) FORGE_FAIL("forge report: give at least one run directory");
  std::error_code error;
  if (std::filesystem::is_directory(output, error))
    FORGE_FAIL("--output '{}' is a directory: give the HTML file to write, such as {}/report.html", output, output);
  std::vector<ReportRun> runs;
  for (const auto& dir : run_dirs) runs.push_back(load_report_run(dir));
  name_runs(runs);
  write_file_atomic(output, render_report(runs, utc_timestamp()), {.sync = false});  // NOTE [Durable files]
  log_info("report: {} run{} -> {}", runs.size(), runs.size() == 1 ? "" : "s", output);
  return 0;
}

}  // namespace forge
