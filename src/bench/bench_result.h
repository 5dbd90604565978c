// BenchResult: one run of `forge bench` — what ran, and what it measured. The runner
// (bench_runner) fills it; the reports (markdown table, JSON, perf.csv) only read it.
//
// Figures follow ../shared/PERF.md: tokens/s/GPU = global batch tokens per step / step
// time / GPUs over the measured (post-warm-up) steps, model TFLOP/s/GPU = tokens/s/GPU x
// FLOPs per token (6 x non-embedding parameters + 6 x layers x hidden x seq), MFU against
// the dense peak of the device's matrix units when the device is known: the bf16 peak for
// every run (for FP8 runs the BF16-equivalent figure, comparable with BF16 runs), and for
// precision.fp8 runs also the fp8 peak (mfu_fp8).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace forge {

struct BenchResult {
  // What ran.
  std::string model;                  // model.name
  std::string precision;              // precision.compute_dtype: bf16 | fp32
  std::string fp8 = "none";           // precision.fp8: none | tensorwise
  bool fp8_routed_experts = true;     // precision.fp8_routed_experts (NOTE [FP8 routed experts switch])
  std::string fp8_filter_fqns;        // precision.fp8_filter_fqns (NOTE [FP8 filter])
  bool fp8_weight_gradient = true;    // precision.fp8_weight_gradient (NOTE [FP8 weight gradient switch])
  int64_t micro_batch = 0;            // training.local_batch_size
  int64_t seq_len = 0;                // training.seq_len
  int64_t grad_accum = 0;             // training.gradient_accumulation_steps
  int64_t global_batch = 0;           // sequences per optimizer step over all GPUs
  int64_t n_gpus = 1;
  std::string parallelism;            // "single", "fsdp 4", ...
  std::string activation_checkpoint;  // none | selective | full
  std::string args;                   // the command-line overrides that define this run, as given
  std::string device_name;            // "NVIDIA H100 80GB HBM3", or the CPU's name
  std::string gpu_architecture;       // "sm_90"; empty on the CPU
  nlohmann::json config;              // the resolved experiment config

  // What happened.
  std::string status = "ok";          // ok | oom | failed
  std::string error;                  // why, when status is not ok
  int64_t warmup_steps = 0;
  int64_t measured_steps = 0;
  double step_time_median_s = 0;
  double step_time_min_s = 0;
  double step_time_max_s = 0;
  double tokens_per_s_per_gpu = 0;
  std::optional<double> images_per_s_per_gpu;  // FLUX runs (NOTE [FLUX benchmarks] in bench_runner.cpp)
  double tflops_per_gpu = 0;          // model TFLOP/s per GPU
  std::optional<double> mfu;          // against the bf16 peak; unset when the device's peak is unknown
  std::optional<double> mfu_fp8;      // FP8 runs: against the fp8 peak; unset otherwise or when unknown
  int64_t peak_memory_bytes = 0;      // device allocator high-water mark (0 on the CPU)
  double duration_s = 0;              // wall time of the whole run, set-up included
};

// The Precision column of the reports: "FP8 (tensorwise)" for a precision.fp8 run, else
// the compute dtype upper-cased ("BF16"). perf.csv writes it in lower case. (Defined in
// bench_report.cpp.)
std::string precision_label(const BenchResult& r);
// An FP8 run's label: "FP8 (tensorwise)", with ", routed experts bf16" (NOTE [FP8 routed
// experts switch]), ", weight gradients bf16" (precision.fp8_weight_gradient false, NOTE [FP8
// weight gradient switch]) and ", bf16: layers.0.,layers.31." (precision.fp8_filter_fqns,
// NOTE [FP8 filter]) where they apply. (Defined in bench_report.cpp.)
std::string fp8_precision_label(const std::string& recipe, bool routed_experts_bf16, bool weight_gradients_bf16,
                                const std::string& filter_fqns);

}  // namespace forge
