// forge mlperf llama31_8b|llama2_70b_lora|flux1 [--runs N] [--seeds S1,S2,...] [--output DIR]
//   [--org NAME] [--platform NAME] [--section.key VALUE ...]
// Runs an MLPerf Training benchmark as its reference does (NOTE [MLPerf reference settings]
// in train/mlperf_benchmark.h), N times with fresh seeds, each run to its quality target
// or to training.steps, writing DIR/result_K.txt (NOTE [MLPerf run timeline]) and the run
// directory DIR/run_K; then, with 3 or more result files in DIR, the score as `forge
// mlperf score DIR` prints it, and DIR/report.html (forge mlperf score --html) in any case. Exit status 0 when every run reached the target, 1 when one
// did not, kExitStopped when a signal stopped one.
#include <fmt/format.h>

#include <filesystem>
#include <random>
#include <set>

#include "cli/commands.h"
#include "cli/config.h"
#include "core/device.h"
#include "core/error.h"
#include "core/exit_status.h"
#include "core/log.h"
#include "core/page_cache.h"
#include "core/stop_signal.h"
#include "data/govreport_dataset.h"
#include "distributed/launch_env.h"
#include "ckpt/flux_latent_cache.h"
#include "train/flux_trainer.h"
#include "train/mlperf_logger.h"
#include "train/mlperf_score.h"
#include "train/trainer.h"

namespace forge {
namespace {

struct MlperfRunArgs {
  int64_t runs = 1;
  std::vector<uint64_t> seeds;
  std::string output = "mlperf-results";
  mlperf::SubmissionInfo info;
  ConfigOverrides overrides;
};

uint64_t parse_seed(const std::string& text) {
  size_t used = 0;
  unsigned long long v = 0;
  try {
    v = std::stoull(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || text[0] == '-' || v > 0xFFFFFFFFull)
    FORGE_FAIL("--seeds: '{}' is not a seed: expected integers from 0 to 4294967295, comma-separated", text);
  return v;
}

MlperfRunArgs parse_args(const std::string& benchmark, const std::vector<std::string>& args) {
  MlperfRunArgs a;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    const bool own = arg == "--runs" || arg == "--seeds" || arg == "--output" || arg == "--org" || arg == "--platform";
    if (!own) {
      rest.push_back(arg);
      continue;
    }
    if (i + 1 >= args.size()) FORGE_FAIL("forge mlperf {}: {} needs a value", benchmark, arg);
    const std::string& v = args[++i];
    if (arg == "--runs") {
      size_t used = 0;
      try {
        a.runs = std::stoll(v, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != v.size() || a.runs < 1 || a.runs > 1000)
        FORGE_FAIL("forge mlperf {}: --runs '{}': expected 1 to 1000 runs", benchmark, v);
    } else if (arg == "--seeds") {
      size_t start = 0;
      while (start <= v.size()) {
        const size_t comma = std::min(v.find(',', start), v.size());
        a.seeds.push_back(parse_seed(v.substr(start, comma - start)));
        start = comma + 1;
      }
    } else if (arg == "--output") {
      a.output = v;
    } else if (arg == "--org") {
      a.info.org = v;
    } else {
      a.info.platform = v;
    }
    if ((arg == "--org" || arg == "--platform") && v.empty())
      FORGE_FAIL("forge mlperf {}: {} is empty: the rules want a name", benchmark, arg);
  }
  a.overrides = parse_overrides(rest);
  if (static_cast<int64_t>(a.seeds.size()) > a.runs)
    FORGE_FAIL("forge mlperf {}: --seeds gives {} seeds for {} run(s): give at most one per run", benchmark,
               a.seeds.size(), a.runs);
  return a;
}

// The first K with neither DIR/result_K.txt nor DIR/run_K: earlier runs in DIR are kept.
int64_t first_free_index(const std::string& dir) {
  for (int64_t k = 0;; ++k)
    if (!std::filesystem::exists(fmt::format("{}/result_{}.txt", dir, k)) &&
        !std::filesystem::exists(fmt::format("{}/run_{}", dir, k)))
      return k;
}

// The files the run reads, for the page-cache eviction behind cache_clear.
std::vector<std::string> data_files(const ExperimentConfig& config) {
  const DataConfig& d = config.data;
  std::vector<std::string> files;
  if (d.source == "indexed")
    for (const std::string& prefix : {d.path, d.validation_path})
      if (!prefix.empty()) files.insert(files.end(), {prefix + ".bin", prefix + ".idx"});
  if (d.source == "govreport_npy")
    files.insert(files.end(), {govreport_npy_file(d.path, Split::Train), govreport_npy_file(d.path, Split::Validation)});
  if (!config.checkpoint.initial_load_path.empty()) files.push_back(config.checkpoint.initial_load_path);
  for (const std::string& cache : {config.flux.data_path, config.flux.eval_data_path}) {  // the caches' files
    std::error_code error;
    if (cache.empty() || !std::filesystem::is_directory(cache, error)) continue;
    for (const auto& entry : std::filesystem::directory_iterator(cache, error))
      if (entry.is_regular_file(error)) files.push_back(entry.path().string());
  }
  return files;
}

// What a run of the benchmark cannot do without (the stand-ins of a smoke test aside).
void check_inputs(const mlperf::Benchmark& b, const ExperimentConfig& config, bool not_benchmark) {
  if (b.name == "llama31_8b" && config.data.source == "indexed" &&
      (config.data.path.empty() || config.data.validation_path.empty()))
    FORGE_FAIL("forge mlperf llama31_8b: give --data.path PREFIX (the training data, "
               "c4-train.en_6_text_document) and --data.validation_path PREFIX "
               "(c4-validation-91205-samples.en_text_document), as the MLCommons download lays them out");
  if (b.lora && config.data.source == "govreport_npy" && config.data.path.empty())
    FORGE_FAIL("forge mlperf llama2_70b_lora: give --data.path DIR, the folder of the GovReport train.npy and "
               "validation.npy");
  if (b.flux && (config.flux.data_path.empty() || config.flux.eval_data_path.empty()))
    FORGE_FAIL("forge mlperf flux1: give --flux.data_path DIR (the training images' latent cache, CC12M) and "
               "--flux.eval_data_path DIR (the validation cache, COCO-2014's 29,696 images), both made by forge "
               "prep --images (README, \"MLPerf Flux.1 data\")");
  if (b.lora && config.checkpoint.initial_load_path.empty() && !not_benchmark)
    FORGE_FAIL("forge mlperf llama2_70b_lora: give --checkpoint.initial_load_path DIR, the Hugging Face Llama 2 "
               "70B folder (config.json and safetensors) the adapters are trained on");
}

// flux1 (NOTE [MLPerf Flux.1]): what of the caches makes the run not the benchmark — the
// cache's image and text sizes replace flux.resolution and flux.text_tokens, and the
// validation set is COCO-2014's 29,696 images. Also the images the validation loss averages.
struct FluxCacheCheck {
  std::vector<std::string> not_benchmark;
  int64_t eval_samples = -1;
};
FluxCacheCheck check_flux_caches(const mlperf::Benchmark& b, const ExperimentConfig& config) {
  FluxCacheCheck r;
  const FluxLatentCache train(config.flux.data_path), eval(config.flux.eval_data_path);
  for (const FluxLatentCache* cache : {&train, &eval}) {
    const FluxCacheManifest& m = cache->manifest();
    if (m.text_tokens != 256)
      r.not_benchmark.push_back(fmt::format("{} holds {} T5 tokens per caption, not 256", cache->folder(), m.text_tokens));
    for (const FluxCacheShard& shard : m.shards)
      if (shard.width != 256 || shard.height != 256) {
        r.not_benchmark.push_back(
            fmt::format("{} holds images of {}x{}, not 256x256", cache->folder(), shard.width, shard.height));
        break;
      }
  }
  r.eval_samples = std::min(eval.size(), config.eval.steps * config.training.local_batch_size);
  if (r.eval_samples != b.eval_samples)
    r.not_benchmark.push_back(fmt::format("{} gives a validation loss over {} images, not COCO-2014's {}", eval.folder(),
                                          r.eval_samples, b.eval_samples));
  return r;
}

}  // namespace

int run_mlperf_benchmark(const std::string& name, const std::vector<std::string>& args) {
  const mlperf::Benchmark& b = mlperf::benchmark(name);
  MlperfRunArgs a = parse_args(name, args);
  const mlperf::RunPlan plan = mlperf::plan_run(b, a.overrides);
  ConfigOverrides overrides(plan.overrides.begin(), plan.overrides.end());
  if (b.flux) {  // before the config's own checks, which would name eval.interval or caption dropout
    ExperimentConfig given;
    for (const auto& [key, value] : plan.overrides) {
      if (key == "flux.data_path") given.flux.data_path = value;
      if (key == "flux.eval_data_path") given.flux.eval_data_path = value;
    }
    check_inputs(b, given, !plan.not_benchmark.empty());
  }
  ExperimentConfig config = load_experiment("", overrides);
  check_inputs(b, config, !plan.not_benchmark.empty());
  FluxCacheCheck caches;
  if (b.flux) caches = check_flux_caches(b, config);

  const LaunchEnv launch = read_launch_env();
  const bool rank0 = launch.rank == 0;
  if (launch.world_size > 1 && static_cast<int64_t>(a.seeds.size()) < a.runs)
    FORGE_FAIL("forge mlperf {}: {} ranks need the same seeds: give --seeds with one seed per run ({})", name,
               launch.world_size, a.runs);
  std::random_device entropy;
  while (static_cast<int64_t>(a.seeds.size()) < a.runs) a.seeds.push_back(entropy() & 0x7FFFFFFFu);
  if (a.info.platform.empty())
    a.info.platform = fmt::format("{}x{}", std::max(launch.world_size, 1),
                                  config.training.device == "cuda" ? accelerator_name() : std::string("CPU"));

  if (rank0) {
    for (const std::string& h : plan.hyperparameters)
      log_info("MLPerf {}: hyperparameter chosen on the command line, as the rules allow: {}", name, h);
    for (const std::string& n : caches.not_benchmark)
      log_warn("MLPerf {}: {}: this run is a smoke test, NOT an MLPerf result", name, n);
    for (const std::string& n : plan.not_benchmark)
      log_warn("MLPerf {}: {} is not the benchmark's: this run is a smoke test, NOT an MLPerf result", name, n);
  }
  std::filesystem::create_directories(a.output);
  install_stop_signal_handlers();  // NOTE [Stop signals]
  const int64_t first = first_free_index(a.output);
  int failed = 0;
  for (int64_t r = 0; r < a.runs; ++r) {
    const int64_t k = first + r;
    const std::string result = fmt::format("{}/result_{}.txt", a.output, k);
    ExperimentConfig run_config = config;
    run_config.training.seed = a.seeds[static_cast<size_t>(r)];
    run_config.logging.run_dir = fmt::format("{}/run_{}", a.output, k);
    if (rank0)
      log_info("MLPerf {} run {} of {}: seed {}, result file {}, run directory {}", name, r + 1, a.runs,
               run_config.training.seed, result, run_config.logging.run_dir);
    const int evicted = evict_from_page_cache(data_files(run_config));
    mlperf::MlperfLogger logger(b, result, rank0, rank0);
    if (rank0) log_info("cache_clear: {} data and weight file(s) evicted from the page cache", evicted);
    bool stopped = false;
    try {
      if (b.flux) {  // NOTE [MLPerf Flux.1]
        FluxTrainer trainer(run_config, to_yaml(run_config));
        logger.header(run_config, run_config.training.seed, a.info, trainer.train_samples(),
                      caches.eval_samples);
        trainer.set_observer(&logger);
        stopped = trainer.run(rank0).stopped;
      } else {
        Trainer trainer(run_config, to_yaml(run_config));
        logger.header(run_config, run_config.training.seed, a.info, trainer.train_data().num_samples());
        trainer.set_observer(&logger);
        stopped = trainer.run().stopped;
      }
    } catch (...) {
      logger.abort();
      // A run that failed before run_start (a bad data file, too little memory) never ran:
      // its result file would only hold cache_clear and init_start, which no checker or
      // score can read, so it is removed; a run that started keeps its log, run_stop aborted.
      if (rank0 && !logger.run_started()) {
        std::error_code ignored;
        std::filesystem::remove(result, ignored);
        log_warn("MLPerf {} run {}: failed before run_start; {} removed", name, r + 1, result);
      }
      throw;
    }
    if (stopped) return kExitStopped;
    if (!logger.succeeded()) ++failed;
    if (rank0)
      log_info("MLPerf {} run {}: {}", name, r + 1,
               logger.succeeded() ? "reached the target" : fmt::format("ended at training.steps {} without reaching "
                                                                       "the target {}", run_config.training.steps,
                                                                       b.target));
  }
  if (rank0) {
    // Every run in DIR, this invocation's and earlier ones', scored when they can be (3 or
    // more), and the HTML report in any case.
    try {
      run_mlperf_score(a.output, name, a.output + "/report.html");
    } catch (const Error& e) {
      log_info("no score yet for {}: {}", a.output, e.what());
    }
  }
  return failed ? 1 : 0;
}

}  // namespace forge
