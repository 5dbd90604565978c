// The trainer's side of NOTE [Non-finite steps] (train/nonfinite.h): finding what made a
// step non-finite, only once its loss or gradient norm says it is, and stopping or skipping;
// and of NOTE [Loss spikes] (train/loss_spike.h): what a loss spike does.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "core/log.h"
#include "model/parameters.h"
#include "train/trainer.h"

namespace forge {
namespace {

constexpr uint32_t kNone = std::numeric_limits<uint32_t>::max();

}  // namespace

void Trainer::inject_test_nan(int64_t step, int64_t micro_batch) {
  if (!inject_nan_ || inject_nan_->step != step || inject_nan_->micro_batch != micro_batch) return;
  if (inject_nan_->fp8_amax) {
    const int64_t projection = fp8_ ? fp8_->projection_index(inject_nan_->tensor) : -1;
    if (projection < 0)
      FORGE_FAIL("FORGE_TEST_INJECT_NAN: '{}' is not a projection trained in FP8 (precision.fp8 {})",
                 inject_nan_->tensor, config_.precision.fp8);
    const int64_t seen = cpu::fp8_seen_offset(projection, cpu::Fp8Role::W);
    poison_first_element(fp8_->statistics().narrow(seen, seen + 1));
    return;
  }
  bool found = false;
  if (sharded_gradients()) {
    const std::vector<ParamSpec> specs = parameter_specs(config_.model);
    const std::vector<FsdpSegment>& segments = fsdp_->layout().segments();
    for (size_t i = 0; i < segments.size(); ++i) {
      if (specs[static_cast<size_t>(segments[i].spec)].name != inject_nan_->tensor) continue;
      found = true;
      poison_first_element(fsdp_->grad_segments()[i]);
    }
    // A rank may hold no part of the tensor.
    found = found || std::any_of(specs.begin(), specs.end(), [&](const ParamSpec& s) { return s.name == inject_nan_->tensor; });
  } else {
    const std::vector<std::string> names = trainable_names();
    for (size_t i = 0; i < names.size(); ++i)
      if (names[i] == inject_nan_->tensor) {
        found = true;
        poison_first_element(trainable_gradients()[i]);
      }
    if (pipeline_) {  // another pipeline rank may hold it
      const std::vector<ParamSpec> specs = parameter_specs(config_.model);
      found = found || std::any_of(specs.begin(), specs.end(), [&](const ParamSpec& s) { return s.name == inject_nan_->tensor; });
    }
  }
  if (!found) FORGE_FAIL("FORGE_TEST_INJECT_NAN: the model has no parameter '{}'", inject_nan_->tensor);
}

// In parameter order; under FSDP every rank scans its chunk and the shard ranks agree on
// the first (replicas hold the same reduced gradients). LoRA's replicated adapters hold the
// same summed gradients on every rank (NOTE [LoRA under data parallelism]).
std::string Trainer::first_nonfinite_gradient() {
  if (pipeline_comm_) return first_over_pipeline(/*weights=*/false);
  if (!sharded_gradients()) {
    const int64_t i = first_nonfinite_tensor(trainable_gradients());
    return i < 0 ? "" : trainable_names()[static_cast<size_t>(i)];
  }
  const std::vector<FsdpSegment>& segments = fsdp_->layout().segments();
  const int64_t i = first_nonfinite_tensor(fsdp_->grad_segments());
  const uint32_t mine = i < 0 ? kNone : static_cast<uint32_t>(segments[static_cast<size_t>(i)].spec);
  const std::vector<uint32_t> all = dp_->all_gather_words({mine});
  const uint32_t first = *std::min_element(all.begin(), all.end());
  return first == kNone ? "" : parameter_specs(config_.model)[first].name;
}

// NOTE [Pipeline parallelism]: each rank holds its stages' parameters (under FSDP its
// chunks of them); the first non-finite weight or gradient in the whole model's parameter
// order, agreed over the data-parallel ranks and then over the pipeline.
std::string Trainer::first_over_pipeline(bool weights) {
  const std::vector<ParamSpec> specs = parameter_specs(config_.model);
  uint32_t mine = kNone;
  if (fsdp_) {
    const int64_t i = first_nonfinite_tensor(weights ? fsdp_->master_segments() : fsdp_->grad_segments());
    if (i >= 0) mine = static_cast<uint32_t>(fsdp_->layout().segments()[static_cast<size_t>(i)].spec);
    const std::vector<uint32_t> all = dp_->all_gather_words({mine});
    mine = *std::min_element(all.begin(), all.end());
  } else {
    const int64_t local = first_nonfinite_tensor(weights ? trainable_weights() : trainable_gradients());
    if (local >= 0)
      for (size_t k = 0; k < specs.size(); ++k)
        if (specs[k].name == trainable_names()[static_cast<size_t>(local)]) mine = static_cast<uint32_t>(k);
  }
  const std::vector<uint32_t> all = pipeline_comm_->all_gather_words({mine});
  const uint32_t first = *std::min_element(all.begin(), all.end());
  return first == kNone ? "" : specs[first].name;
}

// NOTE [Pipeline parallelism]: the step ran its micro-batches together through the
// schedule, so they are not run again one at a time; the ranks agree on what each found.
void Trainer::handle_nonfinite_pipeline(int64_t step, const std::vector<double>& micro_losses, double loss,
                                        double norm, const std::string& fp8_amax) {
  const std::string head =
      fmt::format("non-finite step {} (loss {}, gradient norm {}; training.on_nonfinite stop)", step, loss, norm);
  const std::string weight = first_over_pipeline(/*weights=*/true);
  if (!weight.empty())
    FORGE_FAIL("{}: the weight '{}' is already non-finite before the step's first micro-batch", head, weight);
  if (!fp8_amax.empty())  // NOTE [FP8 under context and pipeline parallelism]: agreed over every rank
    FORGE_FAIL("{}: FP8 (precision.fp8 {}): the first non-finite amax, in parameter order, is {}", head,
               config_.precision.fp8, fp8_amax);
  std::vector<double> bad(micro_losses.size());  // the losses are on the last stage's rank
  for (size_t a = 0; a < bad.size(); ++a) bad[a] = std::isfinite(micro_losses[a]) ? 0.0 : 1.0;
  if (dp_) bad = dp_->sum_over_ranks(bad);  // each data-parallel rank ran its own micro-batches
  bad = pipeline_comm_->sum_over_ranks(bad);
  for (size_t a = 0; a < bad.size(); ++a)
    if (bad[a] > 0)
      FORGE_FAIL("{}: micro-batch {} of {}: the loss (forward pass, on the last pipeline stage) is non-finite", head,
                 a, bad.size());
  const std::string tensor = first_nonfinite_gradient();
  if (!tensor.empty())
    FORGE_FAIL("{}: the first non-finite gradient (in parameter order) of the step's {} micro-batches is '{}' (under "
               "pipeline parallelism they run through the schedule together and are not run again one at a time)",
               head, micro_losses.size(), tensor);
  FORGE_FAIL("{}: the loss sum over micro-batches overflows", head);
}

void Trainer::handle_nonfinite(int64_t step, const std::vector<Batch>& batches, float grad_scale,
                               const std::vector<double>& micro_losses, double loss, double norm,
                               const std::string& fp8_amax) {
  const int64_t accum = static_cast<int64_t>(batches.size());
  if (config_.training.on_nonfinite == "skip") {
    ++skipped_in_a_row_;
    ++skipped_steps_;
    const std::string tensor = first_nonfinite_gradient();
    log_warn("step {}: loss {}, gradient norm {}{}{}: skipped (no optimizer step; {} skipped in a row, {} in all; "
             "training.on_nonfinite skip)",
             step, loss, norm, tensor.empty() ? "" : fmt::format(", first non-finite gradient '{}'", tensor),
             fp8_amax.empty() ? "" : fmt::format(", first non-finite FP8 amax {}", fp8_amax), skipped_in_a_row_,
             skipped_steps_);
    return;
  }
  // Which micro-batch: a single rank names its own; under FSDP the accumulation step.
  auto micro_batch_name = [&](int64_t a) {
    if (!dp_) return fmt::format("micro-batch {} of {}", a, accum);
    return fmt::format("accumulation step {} of {} (micro-batches {}..{} of the global batch, one per rank)", a,
                       accum, a * data_ranks_, a * data_ranks_ + data_ranks_ - 1);
  };
  if (pipeline_comm_) return handle_nonfinite_pipeline(step, micro_losses, loss, norm, fp8_amax);
  const std::string head =
      fmt::format("non-finite step {} (loss {}, gradient norm {}; training.on_nonfinite stop)", step, loss, norm);

  // 1. Weights that are not finite already (a loaded checkpoint or initial weights).
  {
    std::string weight;
    if (!sharded_gradients()) {
      const int64_t i = first_nonfinite_tensor(trainable_weights());
      if (i >= 0) weight = trainable_names()[static_cast<size_t>(i)];
    } else {
      const int64_t i = first_nonfinite_tensor(fsdp_->master_segments());
      const uint32_t mine =
          i < 0 ? kNone : static_cast<uint32_t>(fsdp_->layout().segments()[static_cast<size_t>(i)].spec);
      const std::vector<uint32_t> all = dp_->all_gather_words({mine});
      const uint32_t first = *std::min_element(all.begin(), all.end());
      if (first != kNone) weight = parameter_specs(config_.model)[first].name;
    }
    if (!weight.empty())
      FORGE_FAIL("{}: the weight '{}' is already non-finite before the step's first micro-batch", head, weight);
  }
  // 2. A non-finite FP8 amax (NOTE [FP8 step end]): the projection and tensor whose scale it would make.
  if (!fp8_amax.empty())
    FORGE_FAIL("{}: FP8 (precision.fp8 {}): the first non-finite amax, in parameter order, is {}", head,
               config_.precision.fp8, fp8_amax);
  // 3. A micro-batch whose loss is not finite (the forward pass).
  for (int64_t a = 0; a < accum; ++a) {
    const bool bad_here = !std::isfinite(micro_losses[static_cast<size_t>(a)]);
    const bool bad = dp_ ? dp_->sum_over_ranks(bad_here ? 1.0 : 0.0) > 0 : bad_here;
    if (!bad) continue;
    if (bad_here && dp_)
      FORGE_FAIL("{}: micro-batch {} of the global batch (data-parallel rank {}, accumulation step {}): the loss "
                 "(forward pass) is "
                 "non-finite",
                 head, a * data_ranks_ + data_rank_, data_rank_, a);
    FORGE_FAIL("{}: {}: the loss (forward pass) is non-finite", head, micro_batch_name(a));
  }
  // 4. The summed gradients, then each micro-batch's alone (run again).
  const std::string summed = first_nonfinite_gradient();
  for (int64_t a = 0; a < accum; ++a) {
    const Batch& b = batches[static_cast<size_t>(a)];
    begin_gradients();
    if (fsdp_) fsdp_->begin_micro_batch(true);
    const SequenceLayout layout = sequence_layout(b);
    model_->forward_backward(b.tokens.to(device_), b.targets.to(device_), weights(), gradients(), grad_scale,
                             b.has_examples() ? &layout : nullptr);
    if (fsdp_) fsdp_->end_micro_batch();
    // LoRA under data parallelism: injected before the sum, as in the step.
    if (!sharded_gradients()) inject_test_nan(step, a);
    finish_gradients();
    if (sharded_gradients()) inject_test_nan(step, a);
    const std::string tensor = first_nonfinite_gradient();
    if (!tensor.empty())
      FORGE_FAIL("{}: {}: the first non-finite gradient (in parameter order) is '{}' (found by running the step's "
                 "micro-batches again one at a time)",
                 head, micro_batch_name(a), tensor);
  }
  if (!summed.empty())
    FORGE_FAIL("{}: every micro-batch's gradients are finite, but their sum overflows first in '{}'", head, summed);
  FORGE_FAIL("{}: the loss sum over micro-batches overflows", head);
}

bool Trainer::handle_loss_spike(int64_t step, double loss, const LossSpikeDetector::Verdict& spike) {
  const TrainingConfig& t = config_.training;
  loss_spike_steps_.push_back(step);
  const std::string what = fmt::format(
      "loss spike at step {}: loss {} exceeds training.loss_spike_factor {} × the running mean {} of the last {} "
      "non-spike losses",
      step, loss, t.loss_spike_factor, spike.mean, spike.count);
  if (t.on_loss_spike == "stop") FORGE_FAIL("{} (training.on_loss_spike stop)", what);
  if (t.on_loss_spike == "warn") {
    log_warn("{}; the step's update is applied (training.on_loss_spike warn)", what);
    return false;
  }
  ++skipped_in_a_row_;
  ++skipped_steps_;
  log_warn("{}: skipped (no optimizer step; {} skipped in a row, {} in all; training.on_loss_spike skip)", what,
           skipped_in_a_row_, skipped_steps_);
  return true;
}

}  // namespace forge
