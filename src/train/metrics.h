// What a training run reports: per-step metrics on the console and as JSON Lines in the
// run directory (and as TensorBoard scalars beside them, tensorboard_writer.h), plus the
// throughput arithmetic of ../shared/PERF.md (tokens/s, model TFLOP/s, MFU against the
// device's dense peak when the device is known).
#pragma once

#include <cstdint>
#include <fstream>
#include <array>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/op_profile.h"

namespace forge {

struct StepMetrics {
  int64_t step = 0;  // 1-based optimizer step
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double step_time_s = 0;
  double tokens_per_s = 0;
  double model_tflops = 0;         // per device
  std::optional<double> mfu;       // against the bf16 peak; unset when the device's peak is unknown
  std::optional<double> mfu_fp8;   // precision.fp8 runs: against the fp8 peak; unset otherwise or unknown
  std::optional<int64_t> peak_memory_bytes;  // device allocator high-water mark; unset when not measured
  std::optional<double> comm_exposed_s;      // data-parallel runs: communication not hidden (NOTE [Exposed communication])
  std::optional<std::array<double, kOpClassCount>> op_seconds;  // logging.profile_ops
  std::map<std::string, double> op_seconds_by_op;                // logging.profile_ops
  bool skipped = false;            // non-finite: no optimizer step (NOTE [Non-finite steps])
  int64_t skipped_steps = 0;       // skipped so far in this process
  std::optional<double> loss_spike_mean;  // a loss spike: the mean it exceeded (NOTE [Loss spikes])
  int64_t loss_spikes = 0;         // loss spikes so far in this process
  // A Mixture-of-Experts model's routing over the step's micro-batches: per block, the
  // assignments each expert received (NOTE [MoE feed-forward]); empty for a dense model.
  std::vector<std::vector<int64_t>> expert_load;
  // With token dropping (model.moe_capacity_factor > 0; NOTE [MoE capacity] in ops/moe.h):
  // the share of the step's assignments (every MoE block's tokens x top-k) that were dropped;
  // unset when dropless.
  std::optional<double> expert_dropped_share;
  // The most loaded expert's assignments over the mean per expert, the largest over the
  // blocks (1: perfectly balanced; experts / top-k at most); 0 when dense.
  double expert_load_max_over_mean() const;
};

struct EvalMetrics {
  int64_t step = 0;
  double loss = 0;
  double perplexity = 0;
  int64_t tokens = 0;
};

// Dense bf16 matrix peak (TFLOP/s) for a device name, from PERF.md; unset when unknown.
std::optional<double> peak_tflops(const std::string& device_name);
// Dense fp8 (e4m3) matrix peak (TFLOP/s), from PERF.md: the MFU of precision.fp8 runs
// against it, beside the bf16 figure; unset when unknown.
std::optional<double> peak_fp8_tflops(const std::string& device_name);

// One console line: step, loss, lr, grad norm, tokens/s, step time, TFLOP/s, MFU.
std::string format_step(const StepMetrics& m, int64_t total_steps);
std::string format_eval(const EvalMetrics& m, double entropy_floor);
// The per-class breakdown of one step, with what the classes leave unexplained ("other"),
// then the ops that took longest.
std::string format_op_seconds(const StepMetrics& m);

class TensorBoardWriter;

// Appends one JSON object per line to <run_dir>/metrics.jsonl, flushed per record.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path);
  ~MetricsWriter();
  // From now on, step and eval records also go to a TensorBoard event file in run_dir
  // (logging.enable_tensorboard; NOTE [TensorBoard resume] for resumed_from_step).
  void enable_tensorboard(const std::string& run_dir, int64_t resumed_from_step);
  void write(const StepMetrics& m);
  void write(const EvalMetrics& m);
  void write(const nlohmann::json& record);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream out_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

}  // namespace forge
