// TensorBoard event files, written natively (no TensorFlow, no protobuf library), so that
// `tensorboard --logdir runs` shows a forge run's curves, live while it trains.
//
// One file per start of a run, `events.out.tfevents.<unix seconds>.<hostname>` in the run
// directory, a sequence of TFRecords (tfrecord.h) each holding one tensorflow.Event
// message: first the file-version event, then one event per optimizer step and one per
// evaluation, each a Summary of scalars (tags in NOTE [TensorBoard scalars]). The file is
// flushed after every event.
//
// NOTE [TensorBoard scalars]
//   train/loss, train/lr, train/grad_norm          as in metrics.jsonl
//   throughput/tokens_per_s                        per step, all devices
//   throughput/model_tflops                        model TFLOP/s per device
//   throughput/mfu_percent                         MFU x 100, when the device's peak is known
//   memory/peak_gib                                peak device memory in GiB (2^30 bytes), when measured
//   eval/loss, eval/perplexity                     at each evaluation
// TensorBoard stores simple_value as a 32-bit float, so values read back are the
// metrics.jsonl values rounded to float.
//
// NOTE [TensorBoard resume]
// A resumed run appends to metrics.jsonl but starts a new event file. Its second event is
// a SessionLog START at the first step it will train: TensorBoard then drops the points
// of the earlier files at that step and after, which the interrupted run logged past its
// last checkpoint and the resumed run is about to log again.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include "train/metrics.h"

namespace forge {

class TensorBoardWriter {
 public:
  // Creates the event file in `run_dir`. `resumed_from_step`: the optimizer steps already
  // done when resuming from a checkpoint, 0 for a fresh run.
  TensorBoardWriter(const std::string& run_dir, int64_t resumed_from_step);

  void write(const StepMetrics& m);
  void write(const EvalMetrics& m);
  const std::string& path() const { return path_; }

 private:
  void write_event(const std::string& event);

  std::string path_;
  std::ofstream out_;
};

}  // namespace forge
