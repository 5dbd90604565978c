// TrainingObserver: what a caller of Trainer::run() hears of the step loop, and the two
// decisions it may take over: whether to evaluate after a step, and whether to stop after
// an evaluation. forge mlperf's logger (train/mlperf_logger.h) is one: it writes MLLOG
// block and evaluation lines, evaluates on the benchmark's schedule and stops the run at
// the quality target.
//
// The calls come on rank 0 and every other rank alike, in this order:
//   training_begins                       once, after the run's setup, before step 1
//   step_done                             after each optimizer step
//   evaluation_due -> evaluation_begins -> evaluation_done   after a step that evaluates
//   training_ends                         once, when the loop ends (not when it throws)
// Samples are sequences of the global batch consumed so far (step × global batch).
#pragma once

#include <cstdint>

#include "train/metrics.h"

namespace forge {

class TrainingObserver {
 public:
  virtual ~TrainingObserver() = default;
  virtual void training_begins(int64_t samples) { (void)samples; }
  virtual void step_done(const StepMetrics& m, int64_t samples) { (void)m, (void)samples; }
  // `scheduled`: what eval.interval says for this step (and the last step).
  virtual bool evaluation_due(int64_t step, int64_t samples, bool scheduled) {
    (void)step, (void)samples;
    return scheduled;
  }
  virtual void evaluation_begins(int64_t samples) { (void)samples; }
  // True: stop training after this evaluation.
  virtual bool evaluation_done(const EvalMetrics& e, int64_t samples) { (void)e, (void)samples; return false; }
  // `stopped_by_observer`: evaluation_done asked for the stop; else the loop ran out of
  // steps or a signal stopped it.
  virtual void training_ends(int64_t samples, bool stopped_by_observer) { (void)samples, (void)stopped_by_observer; }
};

}  // namespace forge
