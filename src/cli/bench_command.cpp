// forge bench: runs an experiment (or every combination of a sweep) for warm-up plus
// measured steps on mock data and reports TFLOP/s/GPU, tokens/s/GPU, step time, MFU and
// peak memory as the seeds' tables do (NOTE [What a benchmark run is] in
// bench/bench_runner.h). Results are printed as they come, then as a markdown table,
// written to OUTPUT_DIR/bench.json and appended to perf.csv (ROCm MAD's columns).
//
//   forge bench [EXPERIMENT.yaml] [--warmup N] [--steps N] [--find-max-batch]
//               [--output-dir DIR] [--perf-csv FILE] [--section.key V1,V2,... ...]
#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <unistd.h>

#include <filesystem>
#include <optional>

#include "bench/bench_report.h"
#include "bench/bench_runner.h"
#include "bench/perf_csv.h"
#include "distributed/launch_env.h"
#include "distributed/process_group.h"
#include "train/trainer.h"
#include "cli/bench_sweep.h"
#include "cli/commands.h"
#include "cli/config.h"
#include "core/error.h"
#include "core/log.h"
#include "core/progress.h"

namespace forge {
namespace {

struct BenchCommand {
  std::string experiment;
  ConfigOverrides overrides;
  int64_t warmup = 3;
  int64_t steps = 10;
  bool find_max_batch = false;
  std::string output_dir = "bench";
  std::string perf_csv = "perf.csv";
};

int64_t positive_count(const std::string& flag, const std::string& text, int64_t min) {
  int64_t v = 0;
  size_t used = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || v < min) FORGE_FAIL("forge bench: {} expects an integer >= {}, got '{}'", flag, min, text);
  return v;
}

// Bench flags have no dot; everything with one is a config override.
BenchCommand parse_bench_args(const std::vector<std::string>& args) {
  BenchCommand cmd;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      if (i + 1 >= args.size()) FORGE_FAIL("forge bench: {} needs a value", a);
      return args[++i];
    };
    if (a == "--warmup") cmd.warmup = positive_count(a, value(), 0);
    else if (a == "--steps") cmd.steps = positive_count(a, value(), 1);
    else if (a == "--find-max-batch") cmd.find_max_batch = true;
    else if (a == "--output-dir") cmd.output_dir = value();
    else if (a == "--perf-csv") cmd.perf_csv = value();
    else if (i == 0 && !a.starts_with("--")) cmd.experiment = a;
    else rest.push_back(a);
  }
  if (!rest.empty() && !rest.front().starts_with("--"))
    FORGE_FAIL("forge bench: unexpected argument '{}': give at most one experiment file, then --section.key VALUE "
               "overrides",
               rest.front());
  cmd.overrides = parse_overrides(rest);
  return cmd;
}

nlohmann::json yaml_to_json(const YAML::Node& node) {
  if (node.IsMap()) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& kv : node) j[kv.first.as<std::string>()] = yaml_to_json(kv.second);
    return j;
  }
  if (node.IsSequence()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& item : node) j.push_back(yaml_to_json(item));
    return j;
  }
  if (node.IsNull()) return nullptr;
  return node.as<std::string>();
}

std::string gib(int64_t bytes) { return fmt::format("{:.1f} GiB", static_cast<double>(bytes) / (1 << 30)); }

std::string describe(const BenchResult& r) {
  if (r.status != "ok") return fmt::format("{}: {}", r.status, r.error);
  return fmt::format("{:.1f} TFLOP/s/GPU, {}, step {:.1f} ms (min {:.1f}, max {:.1f}){}, peak {}",
                     r.tflops_per_gpu,
                     r.images_per_s_per_gpu ? fmt::format("{:.3f} images/s/GPU", *r.images_per_s_per_gpu)
                                            : fmt::format("{:.0f} tokens/s/GPU", r.tokens_per_s_per_gpu), r.step_time_median_s * 1e3, r.step_time_min_s * 1e3,
                     r.step_time_max_s * 1e3, (r.mfu ? fmt::format(", MFU {:.1f}%", *r.mfu * 100) : "") +
                         (r.mfu_fp8 ? fmt::format(" (FP8 peak {:.1f}%)", *r.mfu_fp8 * 100) : ""),
                     r.peak_memory_bytes > 0 ? gib(r.peak_memory_bytes) : "n/a (not a GPU run)");
}

class BenchSession {
 public:
  explicit BenchSession(const BenchCommand& cmd) : cmd_(cmd) {}

  // One run of `point` (with micro_batch overriding training.local_batch_size when set).
  BenchResult run(const SweepPoint& point, std::optional<int64_t> micro_batch, int64_t warmup, int64_t steps) {
    ConfigOverrides overrides = point.overrides;
    std::string args = point.args;
    if (micro_batch) {
      overrides.emplace_back("training.local_batch_size", std::to_string(*micro_batch));
      args += fmt::format("{}--training.local_batch_size {}", args.empty() ? "" : " ", *micro_batch);
    }
    // NOTE [What a benchmark run is]: these come last and win over the experiment's.
    overrides.insert(overrides.end(), {{"data.source", "mock"},
                                       {"eval.interval", "0"},
                                       {"checkpoint.enable", "false"},
                                       {"training.steps", std::to_string(warmup + steps)},
                                       {"logging.log_interval", std::to_string(warmup + steps)},
                                       {"logging.run_dir", fmt::format("{}/run{:03d}-{{model}}-{{time}}",
                                                                       cmd_.output_dir, ++runs_)}});
    ExperimentConfig config;
    std::string yaml;
    try {
      config = load_experiment(cmd_.experiment, overrides);
      yaml = to_yaml(config);
    } catch (const Error& e) {
      BenchResult r;
      r.status = "failed";
      r.error = e.what();
      r.args = args;
      return r;
    }
    // Under a launcher, one process group serves every run of the sweep.
    const LaunchEnv env = read_launch_env();
    if (env.world_size > 1 && !world_) world_ = create_process_group(env, process_group_options(config));
    BenchResult r = run_bench(config, yaml, args, warmup, world_.get());
    r.config = yaml_to_json(YAML::Load(yaml));
    return r;
  }

 private:
  const BenchCommand& cmd_;
  int runs_ = 0;
  std::unique_ptr<ProcessGroup> world_;
};

}  // namespace

int run_bench_command(const std::vector<std::string>& args) {
  const BenchCommand cmd = parse_bench_args(args);
  const std::vector<SweepPoint> points = expand_sweep(cmd.overrides);
  if (cmd.find_max_batch)
    for (const SweepPoint& p : points)
      for (const auto& [key, value] : p.overrides)
        if (key == "training.local_batch_size")
          FORGE_FAIL("forge bench: --find-max-batch searches training.local_batch_size; do not set it too");
  // Every combination is resolved before the first run, so that a bad value or file stops
  // a long sweep at once rather than when its turn comes.
  for (const SweepPoint& point : points) {
    try {
      const ExperimentConfig config = load_experiment(cmd.experiment, point.overrides);
      if (cmd.find_max_batch && config.training.device != "cuda")
        FORGE_FAIL("--find-max-batch searches GPU memory: it needs training.device cuda");
    } catch (const Error& e) {
      if (points.size() == 1) throw;
      FORGE_FAIL("forge bench: sweep point {}: {}", point.args, e.what());
    }
  }
  std::filesystem::create_directories(cmd.output_dir);
  BenchSession session(cmd);
  std::vector<BenchResult> results;
  // On a terminal, a bar over the sweep's points (rank 0's); the per-point lines stay.
  std::optional<ProgressReporter> progress;
  if (::isatty(STDERR_FILENO) != 0 && read_launch_env().rank == 0) {
    progress.emplace(true);
    progress->start(static_cast<double>(points.size()), "bench");
  }
  auto sweep_line = [&](const std::string& line) {
    if (progress) progress->clear();
    log_info("{}", line);
  };
  for (size_t i = 0; i < points.size(); ++i) {
    const SweepPoint& point = points[i];
    const std::string label = point.args.empty() ? "(experiment as given)" : point.args;
    std::optional<int64_t> micro_batch;
    if (cmd.find_max_batch) {
      const int64_t best = find_max_micro_batch([&](int64_t mb) {
        const BenchResult probe = session.run(point, mb, 1, 1);
        if (probe.status == "failed")
          FORGE_FAIL("forge bench --find-max-batch: micro-batch {} of {} failed for a reason other than memory: {}",
                     mb, label, probe.error);
        sweep_line(fmt::format("[{}/{}] {}: micro-batch {} {}", i + 1, points.size(), label, mb,
                               probe.status == "ok" ? "fits" : "does not fit"));
        return probe.status == "ok";
      });
      if (best == 0) {
        BenchResult r;
        r.status = "oom";
        r.error = "not even a micro-batch of 1 fits";
        r.args = point.args;
        sweep_line(fmt::format("[{}/{}] {}: {}", i + 1, points.size(), label, describe(r)));
        results.push_back(r);
        continue;
      }
      sweep_line(fmt::format("[{}/{}] {}: largest micro-batch that fits: {}", i + 1, points.size(), label, best));
      micro_batch = best;
    }
    BenchResult r = session.run(point, micro_batch, cmd.warmup, cmd.steps);
    sweep_line(fmt::format("[{}/{}] {}: {}", i + 1, points.size(), r.args.empty() ? label : r.args, describe(r)));
    results.push_back(std::move(r));
    if (progress) progress->update(static_cast<double>(i + 1), fmt::format("{} of {} runs", i + 1, points.size()));
  }
  if (progress) progress->finish();
  // Under a launcher every rank runs every point together (FSDP); rank 0 alone reports.
  if (read_launch_env().rank != 0) {
    int rc = 0;
    for (const BenchResult& r : results)
      if (r.status != "ok") {
        log_warn("{}: {}", r.args, describe(r));
        if (r.status == "failed") rc = 1;
      }
    return rc;
  }
  fmt::print("\n{}\n", bench_markdown_table(results));
  const std::string json_path = cmd.output_dir + "/bench.json";
  write_bench_json(json_path, results);
  log_info("results: {}", json_path);
  if (!cmd.perf_csv.empty()) {
    append_perf_csv(cmd.perf_csv, results, perf_csv_context_from_environment());
    log_info("appended {} row{} to {}", results.size(), results.size() == 1 ? "" : "s", cmd.perf_csv);
  }
  for (const BenchResult& r : results)
    if (r.status == "failed") return 1;
  return 0;
}

}  // namespace forge
