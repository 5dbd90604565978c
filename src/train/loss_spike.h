// NOTE [Loss spikes]
// training.loss_spike_factor F > 0 turns on a loss-spike detector, as OLMo's and
// Megatron-LM users' runs watch for: a step whose (global, all-reduced: every rank decides
// the same) loss exceeds F × the mean of the last training.loss_spike_window steps that were
// not spikes is a spike. Detection starts once the window holds min(window, 10) losses
// (kLossSpikeWarmup): the first steps of a run, and of a run resumed from a checkpoint that
// predates the detector, only fill it. A spike's loss never enters the window, so one spike
// does not raise the bar for the next. Non-finite steps (NOTE [Non-finite steps]) are
// handled before the detector and never reach it. training.on_loss_spike then says what
// happens:
//   warn (default): a warning; the step's update is applied.
//   skip: the step's update is discarded exactly as for a skipped non-finite step (the
//     optimizer is not called: weights, moments and AdamW's step count stay bitwise), and
//     it counts towards training.max_skipped_steps in a row, so a loss that moved up for
//     good stops the run instead of skipping forever.
//   stop: the run ends (exit 1) naming the step, its loss and the running mean.
// metrics.jsonl marks a spike with "loss_spike": true and "loss_spike_mean" (the mean it
// was compared with), "loss_spikes" counts them so far; the count is logged at the end.
// The window is saved in checkpoints (metadata.json "loss_spike"."recent_losses", exact
// doubles), so a resumed run decides as the uninterrupted one; the mean is summed afresh in
// window order every step, never kept as a running sum, so it does not depend on history.
// Tests make loss spikes through FORGE_TEST_SCALE_LOSS=STEP:FACTOR[,STEP:FACTOR...] (1-based
// steps): the step's global loss, as logged and as the detector sees it, is multiplied by
// FACTOR (the gradients are untouched). It is a test hook only; forge warns when it is set.
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

namespace forge {

inline constexpr int64_t kLossSpikeWarmup = 10;

class LossSpikeDetector {
 public:
  // factor 0: off (observe never reports a spike and keeps no losses).
  LossSpikeDetector(double factor, int64_t window);

  struct Verdict {
    bool spike = false;
    double mean = 0;    // the window's mean the loss was compared with (0 while warming up)
    int64_t count = 0;  // how many losses that mean is over (0 while warming up)
  };
  // Judges a finite loss; a loss that is not a spike enters the window.
  Verdict observe(double loss);

  bool enabled() const { return factor_ > 0; }
  // Oldest first; what a checkpoint saves.
  std::vector<double> recent() const { return {recent_.begin(), recent_.end()}; }
  // From a checkpoint: only the newest `window` losses are kept (the window may have shrunk).
  void restore(const std::vector<double>& losses);

 private:
  double factor_;
  int64_t window_;
  std::deque<double> recent_;
};

struct LossScaling {
  int64_t step = 0;  // 1-based optimizer step
  double factor = 1;
};

// FORGE_TEST_SCALE_LOSS, parsed (empty when unset; an error names the variable when it is
// malformed).
std::vector<LossScaling> loss_scalings_from_env();

}  // namespace forge
