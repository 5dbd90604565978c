// The MLPerf Training benchmarks forge runs (`forge mlperf llama31_8b`, `forge mlperf
// llama2_70b_lora`, `forge mlperf flux1`), as the MLCommons reference implementations and
// the training rules define them, and how a user's overrides are judged against those rules.
//
// NOTE [MLPerf reference settings]
// Sources (the README cites each value): mlcommons/training at aa344c7f,
// small_llm_pretraining/nemo/pretrain_llama31.py and README.md (8B), llama2_70b_lora/
// run_llama_70B_scrolls_r16.sh, scripts/train.py, scripts/mlperf_logging_utils.py (LoRA);
// mlcommons/training_policies at d73e20f, training_rules.adoc, the hyperparameter table
// (what a closed submission may choose) and "Quality measure" (evaluation cadence); the
// RCP files of mlperf-logging 4.1.68 (the base LR and warm-up the references used at each
// global batch size). Flux.1 (NOTE [MLPerf Flux.1]) takes its fixed values from
// compliance_checker/training_5.1.0/closed_flux1.yaml and its reference, torchtitan's
// experiments/flux (flux_schnell_mlperf_preprocessed.toml, train.py, flux_dataset.py). A run
// is planned from them:
//   reference    fixed by the rules: model, sequence length, optimizer, betas, epsilon,
//                weight decay, clipping, schedule shape, LoRA rank/alpha/dropout/targets,
//                evaluation cadence, size and target. Overriding one is refused, naming
//                the rule.
//   hyperparameter  the rules let a submitter choose it (global batch, base LR, warm-up,
//                accumulation, and for LoRA the schedule's training steps): accepted, and
//                the run says which it changed. Without a base LR or warm-up of its own,
//                a global batch that one of the RCPs used takes that RCP's; another batch
//                needs both given.
//   system       how the work is done, not what is computed: device, micro-batch,
//                precision (FP8 included), activation checkpointing, parallelism, data
//                and weight paths, logging. Accepted silently.
//   not the benchmark  a smaller model, shorter sequences (smaller images) or other data, for smoke tests
//                (CI runs both benchmarks this way): accepted, but the run warns that
//                its result is not an MLPerf result, and the MLLOG lines log the values
//                actually used (a compliance checker then names the rule they break).
//
// NOTE [MLPerf Flux.1]
// `forge mlperf flux1`: FLUX.1-schnell's architecture (flux1-schnell) trained from scratch
// at 256 x 256 (256 latent tokens) with 256 T5 tokens on CC12M's latent cache
// (flux.data_path), evaluated on COCO-2014's 29,696-image validation subset (flux.eval_data_path)
// every 262,144 training images (closed_flux1.yaml's evaluation_frequency) by the validation
// loss (NOTE [FLUX validation loss]); a loss at or below 0.586 ends the run. The reference's
// recipe: t uniform in [0, 1) with no shift, torchtitan's init (flux.weight_init
// torchtitan), caption dropout 0.1 (classifer_free_guidance_prob), AdamW betas 0.9/0.95, eps
// 1e-8, weight decay 0.1, clipping at 1.0, a linear warm-up then a constant LR (the toml's
// decay_ratio 0.0); the base LR and warm-up at each RCP batch (512, 1024, 2048, 4096). The
// caches are made by `forge prep --images` (README, "MLPerf Flux.1 data").
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace forge::mlperf {

using KeyValues = std::vector<std::pair<std::string, std::string>>;

struct Benchmark {
  std::string name;             // llama31_8b | llama2_70b_lora | flux1
  std::string model;            // the forge model file: llama3.1-8b | llama2-70b; flux1: flux.model
  double target = 0;            // an eval_accuracy at or below it ends the run with success
  std::string metric;           // what eval_accuracy holds: "log perplexity" | "evaluation loss" | "validation loss"
  int64_t eval_interval_samples = 0;  // 12,288 | 384 | 262,144 (rounded up to whole global batches)
  int64_t eval_samples = 0;           // 1,024 | 173 | 29,696
  int64_t reference_batch = 0;        // the reference's global batch: 32 | 8 | 512
  bool lora = false;
  bool flux = false;                  // flux1: a FLUX run (NOTE [MLPerf Flux.1])
};

const Benchmark& benchmark(const std::string& name);  // throws naming the two benchmarks
std::vector<std::string> benchmark_names();

// The evaluations the rules skip before the first (LoRA: FLOOR(0.125 × global batch + 2);
// 8B: none), and the steps between evaluations (CEIL(interval / global batch)).
int64_t skipped_evaluations(const Benchmark& b, int64_t global_batch);
int64_t eval_interval_steps(const Benchmark& b, int64_t global_batch);

enum class KeyRole { Reference, Hyperparameter, System, NotBenchmark };
// The role of config key `key` in benchmark `b` (NOTE [MLPerf reference settings]); an
// unknown key is Reference (refused).
KeyRole key_role(const Benchmark& b, const std::string& key);

struct RunPlan {
  KeyValues overrides;                   // the reference's keys, then the user's, for load_experiment
  std::vector<std::string> hyperparameters;  // lines saying what the user chose, e.g. "optimizer.lr 0.001 (...)"
  std::vector<std::string> not_benchmark;    // the keys that make the run not an MLPerf result
  int64_t global_batch = 0, local_batch = 0;
};

// The run of `b` with the user's --section.key overrides: the reference's settings at the
// run's global batch (NOTE [MLPerf reference settings]) followed by the user's. Throws
// naming the key for a refused override, an unparsable number, a global batch without an
// RCP and no LR or warm-up of the user's, and a micro-batch that does not divide the
// evaluation samples.
RunPlan plan_run(const Benchmark& b, const KeyValues& user);

}  // namespace forge::mlperf
