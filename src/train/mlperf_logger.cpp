// One MLPerf run's MLLOG lines: NOTE [MLPerf run timeline] in mlperf_logger.h.
#include "train/mlperf_logger.h"

#include "core/error.h"
#include "core/log.h"

namespace forge::mlperf {

using mllog::Json;

MlperfLogger::MlperfLogger(const Benchmark& benchmark, const std::string& result_path, bool write, bool echo,
                           mllog::Writer::Clock clock)
    : b_(benchmark) {
  if (write) log_ = std::make_unique<mllog::Writer>(result_path, echo, "", std::move(clock));
  if (!log_) return;
  log_->event(mllog::kCacheClear, true);
  log_->start(mllog::kInitStart);
}

const std::string& MlperfLogger::path() const {
  static const std::string none;
  return log_ ? log_->path() : none;
}

void MlperfLogger::header(const ExperimentConfig& config, uint64_t seed, const SubmissionInfo& info,
                          int64_t train_samples, int64_t eval_samples) {
  const TrainingConfig& t = config.training;
  global_batch_ = t.global_batch_size;
  interval_steps_ = config.eval.interval;
  skipped_ = skipped_evaluations(b_, global_batch_);
  if (eval_samples < 0) eval_samples = config.eval.steps * t.local_batch_size;
  if (!log_) return;
  log_->event(mllog::kSubmissionBenchmark, b_.name);
  log_->event(mllog::kSubmissionOrg, info.org);
  log_->event(mllog::kSubmissionDivision, info.division);
  log_->event(mllog::kSubmissionStatus, info.status);
  log_->event(mllog::kSubmissionPlatform, info.platform);
  log_->event(mllog::kSeed, seed);
  log_->event(mllog::kGlobalBatchSize, t.global_batch_size);
  log_->event(mllog::kGradientAccumulationSteps, t.gradient_accumulation_steps);
  if (b_.flux) {  // NOTE [MLPerf Flux.1]: closed_flux1.yaml's keys
    log_->event(mllog::kEvaluationFrequency, b_.eval_interval_samples);
    log_->event(mllog::kTrainSamples, train_samples);
    log_->event(mllog::kOptLearningRateWarmupSteps, config.lr_scheduler.warmup_steps);
  } else {
    // The tokens of a sample: the sequence length the references configure (8B: seq_length
    // 8192 inputs; LoRA: blocks of 8,192 tokens, 8,191 inputs).
    log_->event(mllog::kMaxSequenceLength, b_.lora ? t.seq_len + 1 : t.seq_len);
  }
  log_->event(mllog::kEvalSamples, eval_samples);
  log_->event(mllog::kOptName, config.optimizer.name);
  log_->event(mllog::kOptBaseLearningRate, config.optimizer.lr);
  log_->event(mllog::kOptAdamwBeta1, config.optimizer.beta1);
  log_->event(mllog::kOptAdamwBeta2, config.optimizer.beta2);
  log_->event(mllog::kOptAdamwEpsilon, config.optimizer.eps);
  log_->event(mllog::kOptAdamwWeightDecay, config.optimizer.weight_decay);
  log_->event(mllog::kOptGradientClipNorm, t.max_norm);
  const LRSchedulerConfig& lr = config.lr_scheduler;
  if (b_.flux) return;
  if (!b_.lora) {
    log_->event(mllog::kOptEndLearningRate, lr.min_lr);
    log_->event(mllog::kOptLearningRateWarmupSteps, lr.warmup_steps);
    log_->event(mllog::kOptLearningRateDecaySteps, lr.decay_steps);
    log_->event(mllog::kOptLearningRateDecaySchedule, "cosine with linear warmup");
    log_->event(mllog::kMaxSteps, lr.warmup_steps + lr.decay_steps);
  } else {
    log_->event(mllog::kTrainSamples, train_samples);
    log_->event(mllog::kOptLearningRateWarmupFactor,
                static_cast<double>(lr.warmup_steps) / static_cast<double>(t.steps));
    log_->event(mllog::kOptLearningRateTrainingSteps, t.steps);
    log_->event(mllog::kLoraRank, config.lora.rank);
    log_->event(mllog::kLoraAlpha, config.lora.alpha);
  }
}

void MlperfLogger::training_begins(int64_t samples) {
  run_started_ = true;
  in_block_ = true;
  last_samples_ = samples;
  if (!log_) return;
  log_->end(mllog::kInitStop);
  log_->start(mllog::kRunStart);
  log_->start(mllog::kBlockStart, nullptr, {{mllog::kSamplesCount, samples}});
}

void MlperfLogger::step_done(const StepMetrics& m, int64_t samples) {
  last_samples_ = samples;
  block_seconds_ += m.step_time_s;
  block_tokens_per_gpu_ += m.tokens_per_s * m.step_time_s;
  block_tflop_per_gpu_ += m.model_tflops * m.step_time_s;
  ++block_steps_;
}

bool MlperfLogger::evaluation_due(int64_t step, int64_t samples, bool scheduled) {
  (void)samples, (void)scheduled;
  return !succeeded_ && step % interval_steps_ == 0 && step / interval_steps_ > skipped_;
}

void MlperfLogger::evaluation_begins(int64_t samples) {
  if (log_ && block_seconds_ > 0 && b_.flux)  // images/s and TFLOP/s/GPU (FLUX runs count no tokens)
    log_->event(mllog::kTrackedStats,
                {{"throughput", static_cast<double>(block_steps_ * global_batch_) / block_seconds_},
                 {"tflops_per_gpu", block_tflop_per_gpu_ / block_seconds_}},
                {{mllog::kStep, samples}});
  else if (log_ && block_seconds_ > 0)
    log_->event(mllog::kTrackedStats,
                {{"throughput", static_cast<double>(block_steps_ * global_batch_) / block_seconds_},
                 {"tokens_per_s_per_gpu", block_tokens_per_gpu_ / block_seconds_},
                 {"tflops_per_gpu", block_tflop_per_gpu_ / block_seconds_}},
                {{mllog::kStep, samples}});
  block_seconds_ = block_tokens_per_gpu_ = block_tflop_per_gpu_ = 0;
  block_steps_ = 0;
  in_block_ = false;
  if (!log_) return;
  log_->end(mllog::kBlockStop, nullptr, {{mllog::kSamplesCount, samples}});
  log_->start(mllog::kEvalStart, nullptr, {{mllog::kSamplesCount, samples}});
}

bool MlperfLogger::evaluation_done(const EvalMetrics& e, int64_t samples) {
  succeeded_ = e.loss <= b_.target && e.loss > 0;
  if (log_) {
    log_->event(mllog::kEvalAccuracy, e.loss, {{mllog::kSamplesCount, samples}});
    log_->end(mllog::kEvalStop, nullptr, {{mllog::kSamplesCount, samples}});
  }
  if (succeeded_) {
    log_info("MLPerf {}: {} {:.4f} at {} samples reaches the target {}", b_.name, b_.metric, e.loss, samples,
             b_.target);
    return true;
  }
  in_block_ = true;
  if (log_) log_->start(mllog::kBlockStart, nullptr, {{mllog::kSamplesCount, samples}});
  return false;
}

void MlperfLogger::training_ends(int64_t samples, bool stopped_by_observer) {
  (void)stopped_by_observer;
  if (ended_ || !run_started_) return;
  ended_ = true;
  if (!log_) return;
  if (in_block_) log_->end(mllog::kBlockStop, nullptr, {{mllog::kSamplesCount, samples}});
  log_->end(mllog::kRunStop, nullptr,
            {{mllog::kSamplesCount, samples}, {mllog::kStatus, succeeded_ ? mllog::kSuccess : mllog::kAborted}});
  if (!b_.lora && !b_.flux) log_->event(mllog::kTrainSamples, samples);
}

void MlperfLogger::abort() {
  succeeded_ = false;
  training_ends(last_samples_, false);
}

}  // namespace forge::mlperf
