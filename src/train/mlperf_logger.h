// MlperfLogger: one MLPerf run's MLLOG result file, written from the training loop's
// events (a TrainingObserver), and the benchmark's evaluation schedule and stopping rule.
//
// NOTE [MLPerf run timeline]
// The lines come in the order and at the moments the references write them
// (small_llm_pretraining/nemo/callbacks.py MLPerfCallback, llama2_70b_lora/scripts/
// mlperf_logging_utils.py) and the training rules' timing section allows:
//   constructed        cache_clear (after the run's data files are evicted from the page
//                      cache), init_start: the clock of the 30-minute initialization limit
//   header()           submission_*, seed, the hyperparameters (from the resolved config;
//                      flux1: closed_flux1.yaml's, evaluation_frequency and train_samples, the
//                      training cache's images, among them)
//   training_begins    init_stop: the model is built and its weights loaded by then (the
//                      trainer loads them at the start of run()); run_start (time-to-train
//                      starts), block_start {samples_count 0}
//   evaluation_begins  tracked_stats (the block's samples/s, tokens/s/GPU (not for flux1),
//                      TFLOP/s/GPU),
//                      block_stop, eval_start
//   evaluation_done    eval_accuracy {samples_count} (the log perplexity or evaluation
//                      loss), eval_stop; at or below the target: the run has succeeded,
//                      else the next block_start
//   training_ends      run_stop {samples_count, status success|aborted}, then (8B, as the
//                      reference) train_samples: the samples trained on
// samples_count is the training sequences (flux1: images) consumed before the event (step
// × global batch). Evaluations come every CEIL(interval / global batch) steps after the rules'
// skipped ones; a run that ends without reaching the target (training.steps, a signal, an
// error: abort()) logs run_stop with status aborted. Only rank 0 writes; other ranks' loggers
// are silent.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "train/experiment.h"
#include "train/mlperf_benchmark.h"
#include "train/mllog.h"
#include "train/training_observer.h"

namespace forge::mlperf {

struct SubmissionInfo {
  std::string org = "forge";
  std::string platform;  // e.g. "1xNVIDIA H200"
  std::string division = "closed";
  std::string status = "onprem";
};

class MlperfLogger : public TrainingObserver {
 public:
  // Opens (appends to) `result_path` when `write` (rank 0) and logs cache_clear, init_start.
  // `clock`: milliseconds since the epoch (tests); default the system clock.
  MlperfLogger(const Benchmark& benchmark, const std::string& result_path, bool write, bool echo,
               mllog::Writer::Clock clock = {});

  // submission_*, seed, the hyperparameters of `config` as the rules name them.
  // `train_samples`: the training set's sequences (LoRA logs them here, as the reference).
  // `eval_samples`: the samples an evaluation covers; -1: eval.steps x training.local_batch_size.
  void header(const ExperimentConfig& config, uint64_t seed, const SubmissionInfo& info, int64_t train_samples,
              int64_t eval_samples = -1);

  void training_begins(int64_t samples) override;
  void step_done(const StepMetrics& m, int64_t samples) override;
  bool evaluation_due(int64_t step, int64_t samples, bool scheduled) override;
  void evaluation_begins(int64_t samples) override;
  bool evaluation_done(const EvalMetrics& e, int64_t samples) override;
  void training_ends(int64_t samples, bool stopped_by_observer) override;
  // The run failed (an exception): closes the open block and logs run_stop aborted at the
  // samples of the last step done, if the run had started.
  void abort();

  bool succeeded() const { return succeeded_; }
  bool run_started() const { return run_started_; }
  const std::string& path() const;

 private:
  const Benchmark& b_;
  std::unique_ptr<mllog::Writer> log_;  // null on ranks other than 0
  int64_t global_batch_ = 0, interval_steps_ = 1, skipped_ = 0;
  bool run_started_ = false, in_block_ = false, succeeded_ = false, ended_ = false;
  // The open block's measured steps: seconds, and the per-GPU tokens and FLOPs those steps did.
  double block_seconds_ = 0, block_tokens_per_gpu_ = 0, block_tflop_per_gpu_ = 0;
  int64_t block_steps_ = 0;
  int64_t last_samples_ = 0;  // after the last step done
};

}  // namespace forge::mlperf
