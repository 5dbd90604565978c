// forge_mllog_synthetic: MLLOG result files through forge's writer (train/mllog.h) for
// tests/python/test_mlperf_logging.py, which runs the mlperf-logging checkers on them.
//
//   forge_mllog_synthetic log BENCHMARK FILE [--samples N] [--minutes M] [--batch B]
//       [--status success|aborted|none] [--omit KEY] [--set KEY=JSON] [--start-ms T]
//       [--tracked-stats throughput|all] [--throughput S]
//     A complete synthetic run of llama31_8b, llama2_70b_lora or flux1 with the reference
//     hyperparameters the 5.1 rules check (compliance_checker/training_5.1.0/
//     closed_<benchmark>.yaml): header, init, run_start, a block + evaluation every
//     evaluation interval up to N samples (the last evaluation reaches the target unless the
//     status is not success), run_stop
//     with the status (none: no run_stop) M minutes after run_start. --omit drops every line
//     of KEY; --set replaces the value of the header line KEY. Each block logs tracked_stats
//     with throughput S samples/s (default 12.5), and with --tracked-stats all also
//     tokens_per_s_per_gpu (S x 8192 / 8 GPUs) and tflops_per_gpu (that x 6 x 8e9 / 1e12),
//     as forge's run mode does.
//   forge_mllog_synthetic rcps
//     The embedded RCP tables (train/mlperf_rcp.h) and their statistics as JSON.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "train/mllog.h"
#include "train/mlperf_rcp.h"

namespace forge {
namespace {

using mllog::Json;

struct Options {
  std::string benchmark, file, status = "success", tracked_stats = "throughput";
  double throughput = 12.5;
  int64_t samples = -1, batch = -1, start_ms = 1732000000000;
  double minutes = 100;
  std::set<std::string> omit;
  std::map<std::string, Json> set;
};

struct Benchmark {
  int64_t batch, eval_interval, default_samples;
  double first_eval;
  std::vector<std::pair<std::string, Json>> header;  // the hyperparameter lines, in order
};

// The reference values of the rules (closed_*.yaml checks several exactly) and of the
// reference implementations' logs; the ones no rule checks are marked.
Benchmark benchmark_of(const std::string& name, int64_t batch) {
  if (name == "llama31_8b") {
    if (batch < 0) batch = 32;
    const int64_t warmup_steps = 4096 / batch;  // 4,096 warm-up samples
    return {batch, 12288, 184320, 4.2, {
      {mllog::kGlobalBatchSize, batch},
      {mllog::kGradientAccumulationSteps, 1},
      {mllog::kMaxSequenceLength, 8192},
      {mllog::kOptName, "adamw"},
      {mllog::kOptBaseLearningRate, 8e-4},
      {mllog::kOptEndLearningRate, 8e-5},  // not checked by the rules: a plausible value
      {mllog::kOptLearningRateWarmupSteps, warmup_steps},
      {mllog::kOptLearningRateDecaySteps, 1200000 - warmup_steps},
      {mllog::kOptLearningRateDecaySchedule, "cosine with linear warmup"},
      {mllog::kOptAdamwBeta1, 0.9},
      {mllog::kOptAdamwBeta2, 0.95},
      {mllog::kOptAdamwEpsilon, 1e-05},
      {mllog::kOptAdamwWeightDecay, 0.1},
      {mllog::kOptGradientClipNorm, 1.0},
      {mllog::kMaxSteps, 1200000},
      {mllog::kTrainSamples, 1200000 * batch},  // not checked beyond being present: a plausible value
      {mllog::kEvalSamples, 1024},
    }};
  }
  if (name == "llama2_70b_lora") {
    if (batch < 0) batch = 8;
    return {batch, 384, 3072, 1.1, {
      {mllog::kGlobalBatchSize, batch},
      {mllog::kGradientAccumulationSteps, 1},
      {mllog::kMaxSequenceLength, 8192},
      {mllog::kOptName, "adamw"},
      {mllog::kOptBaseLearningRate, 4e-4},
      {mllog::kOptLearningRateWarmupSteps, 0},
      {mllog::kOptLearningRateTrainingSteps, 1024},
      {mllog::kOptAdamwWeightDecay, 1e-4},
      {mllog::kOptGradientClipNorm, 0.3},
      {mllog::kLoraRank, 16},
      {mllog::kLoraAlpha, 32},
      {mllog::kTrainSamples, 3901},
      {mllog::kEvalSamples, 173},
    }};
  }
  if (name == "flux1") {  // closed_flux1.yaml; rcps_flux1.json's hyperparameters at 512
    if (batch < 0) batch = 512;
    return {batch, 262144, 8388608, 1.2, {
      {mllog::kGlobalBatchSize, batch},
      {mllog::kGradientAccumulationSteps, 1},
      {mllog::kEvaluationFrequency, 262144},
      {mllog::kTrainSamples, 10000000},  // not checked beyond being present: a plausible value
      {mllog::kEvalSamples, 29696},
      {mllog::kOptName, "adamw"},
      {mllog::kOptBaseLearningRate, 2e-4},
      {mllog::kOptAdamwBeta1, 0.9},
      {mllog::kOptAdamwBeta2, 0.95},
      {mllog::kOptAdamwEpsilon, 1e-08},
      {mllog::kOptAdamwWeightDecay, 0.1},
      {mllog::kOptGradientClipNorm, 1.0},
      {mllog::kOptLearningRateWarmupSteps, 1600},
    }};
  }
  FORGE_FAIL("benchmark '{}': llama31_8b, llama2_70b_lora or flux1", name);
}

void write_log(const Options& o) {
  const Benchmark b = benchmark_of(o.benchmark, o.batch);
  const int64_t samples = o.samples > 0 ? o.samples : b.default_samples;
  FORGE_CHECK(samples % b.eval_interval == 0, "--samples {} is not a multiple of the evaluation interval {}", samples,
              b.eval_interval);
  std::filesystem::remove(o.file);
  int64_t now = o.start_ms;
  mllog::Writer log(o.file, false, "", [&] { return now; });
  auto value = [&](const std::string& key, Json v) { return o.set.count(key) ? o.set.at(key) : v; };
  auto event = [&](const std::string& key, Json v, Json metadata = nullptr) {
    if (!o.omit.count(key)) log.event(key, value(key, std::move(v)), metadata);
  };
  auto start = [&](const std::string& key, Json metadata = nullptr) {
    if (!o.omit.count(key)) log.start(key, nullptr, metadata);
  };
  auto end = [&](const std::string& key, Json metadata = nullptr) {
    if (!o.omit.count(key)) log.end(key, nullptr, metadata);
  };

  event(mllog::kCacheClear, true);
  start(mllog::kInitStart);
  event(mllog::kSubmissionBenchmark, o.benchmark);
  event(mllog::kSubmissionOrg, "forge");
  event(mllog::kSubmissionDivision, "closed");
  event(mllog::kSubmissionStatus, "onprem");
  event(mllog::kSubmissionPlatform, "synthetic");
  event(mllog::kSeed, 1234);
  for (const auto& [key, v] : b.header) event(key, v);
  now += 60 * 1000;  // model load and compilation: well inside the 30 minutes the closed rules allow
  end(mllog::kInitStop);
  now += 1000;
  const int64_t run_start = now;
  start(mllog::kRunStart);
  const int64_t evals = samples / b.eval_interval;
  const double target = mlperf::rcp_benchmark(o.benchmark).target;
  const double total_ms = o.minutes * 60 * 1000;
  for (int64_t i = 1; i <= evals; ++i) {
    const int64_t first = (i - 1) * b.eval_interval, last = i * b.eval_interval;
    start(mllog::kBlockStart, {{mllog::kSamplesCount, first}});
    now = run_start + static_cast<int64_t>(total_ms * static_cast<double>(i) / static_cast<double>(evals)) - 500;
    Json stats = {{"throughput", o.throughput}};
    if (o.tracked_stats == "all") {
      const double tokens_per_gpu = o.throughput * 8192 / 8;
      stats["tokens_per_s_per_gpu"] = tokens_per_gpu;
      stats["tflops_per_gpu"] = tokens_per_gpu * 6 * 8e9 / 1e12;
    }
    event(mllog::kTrackedStats, stats, {{mllog::kStep, last}});
    end(mllog::kBlockStop, {{mllog::kSamplesCount, last}});
    start(mllog::kEvalStart, {{mllog::kSamplesCount, last}});
    // A run that does not end in success never reaches the target (as the checkers expect).
    const double last_accuracy = o.status == "success" ? target : target + 0.05;
    const double accuracy =
        evals == 1 ? last_accuracy : b.first_eval + (last_accuracy - b.first_eval) * (i - 1) / (evals - 1);
    now += 400;
    event(mllog::kEvalAccuracy, accuracy, {{mllog::kSamplesCount, last}});
    end(mllog::kEvalStop, {{mllog::kSamplesCount, last}});
  }
  now = run_start + static_cast<int64_t>(total_ms);
  if (o.status != "none") end(mllog::kRunStop, {{mllog::kSamplesCount, samples}, {mllog::kStatus, o.status}});
}

void print_rcps() {
  Json all = Json::object();
  for (const auto& name : mlperf::rcp_benchmark_names()) {
    const auto& b = mlperf::rcp_benchmark(name);
    Json records = Json::object();
    for (const auto& r : b.records)
      records[r.name] = {{"BS", r.batch}, {"samples", r.samples_to_converge}, {"mean", r.mean},
                         {"stdev", r.stdev}, {"min_mean", r.min_mean}};
    Json pruned = Json::array();
    for (const auto& r : mlperf::pruned_rcps(b)) pruned.push_back(r.name);
    all[name] = {{"submission_runs", b.submission_runs}, {"records", records}, {"pruned", pruned}};
  }
  std::printf("%s\n", all.dump(1).c_str());
}

int run(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 1 && args[0] == "rcps") {
    print_rcps();
    return 0;
  }
  FORGE_CHECK(args.size() >= 3 && args[0] == "log", "usage: forge_mllog_synthetic log BENCHMARK FILE [options] | rcps");
  Options o;
  o.benchmark = args[1];
  o.file = args[2];
  for (size_t i = 3; i < args.size(); i += 2) {
    FORGE_CHECK(i + 1 < args.size(), "{} needs a value", args[i]);
    const std::string& flag = args[i];
    const std::string& v = args[i + 1];
    if (flag == "--samples") o.samples = std::stoll(v);
    else if (flag == "--minutes") o.minutes = std::stod(v);
    else if (flag == "--batch") o.batch = std::stoll(v);
    else if (flag == "--status") o.status = v;
    else if (flag == "--start-ms") o.start_ms = std::stoll(v);
    else if (flag == "--throughput") o.throughput = std::stod(v);
    else if (flag == "--tracked-stats") {
      FORGE_CHECK(v == "throughput" || v == "all", "--tracked-stats throughput or all, got {}", v);
      o.tracked_stats = v;
    }
    else if (flag == "--omit") o.omit.insert(v);
    else if (flag == "--set") {
      const size_t eq = v.find('=');
      FORGE_CHECK(eq != std::string::npos, "--set KEY=JSON, got {}", v);
      o.set[v.substr(0, eq)] = Json::parse(v.substr(eq + 1));
    } else FORGE_FAIL("unknown option {}", flag);
  }
  write_log(o);
  return 0;
}

}  // namespace
}  // namespace forge

int main(int argc, char** argv) {
  try {
    return forge::run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
