#include "bench/bench_runner.h"

#include <algorithm>
#include <chrono>
#include <vector>

#include "bench/median.h"
#include "core/device.h"
#include "core/error.h"
#include "model/lora.h"
#include "train/metrics.h"
#include "train/flux_trainer.h"
#include "train/trainer.h"

namespace forge {
namespace {

// Runs `measure`, turning an out-of-memory error into status "oom" and any other forge
// error into "failed", with the message.
template <typename Measure>
void catching_failures(BenchResult& r, Measure measure) {
  try {
    measure();
  } catch (const OutOfMemoryError& e) {
    r.status = "oom";
    r.error = e.what();
  } catch (const Error& e) {
    r.status = "failed";
    r.error = e.what();
  }
}

// NOTE [FLUX benchmarks]: images per second per GPU as the seeds report FLUX (frames/s),
// model TFLOP/s by NOTE [FLUX FLOPs]; tokens/s counts image and text tokens.
void run_flux_bench(const ExperimentConfig& c, BenchResult& r, ProcessGroup* world) {
  const FluxConfig model = flux_model_config(c.flux);
  const FluxShape shape = flux_micro_batch_shape(c);
  r.model = model.num_double_blocks == flux_preset(c.flux.model).num_double_blocks &&
                    model.num_single_blocks == flux_preset(c.flux.model).num_single_blocks
                ? c.flux.model
                : fmt::format("{} ({}+{} blocks)", c.flux.model, model.num_double_blocks, model.num_single_blocks);
  r.seq_len = shape.tokens();
  r.global_batch = shape.batch * r.grad_accum;
  catching_failures(r, [&] {
    FluxTrainResult run;
    {
      FluxTrainer trainer(c, "", world);
      run = trainer.run(false);
    }
    std::vector<double> measured(run.step_seconds.begin() + r.warmup_steps, run.step_seconds.end());
    r.step_time_median_s = median(measured).value();
    r.step_time_min_s = *std::min_element(measured.begin(), measured.end());
    r.step_time_max_s = *std::max_element(measured.begin(), measured.end());
    const double images = static_cast<double>(r.global_batch) / r.step_time_median_s;
    r.images_per_s_per_gpu = images;
    r.tokens_per_s_per_gpu = images * static_cast<double>(shape.tokens());
    r.tflops_per_gpu = images * model.training_flops_per_image(shape.image_tokens(), shape.text_tokens) / 1e12;
    if (const auto peak = peak_tflops(r.device_name)) r.mfu = r.tflops_per_gpu / *peak;
  });
}

}  // namespace

BenchResult run_bench(const ExperimentConfig& c, const std::string& resolved_yaml, const std::string& args,
                      int64_t warmup_steps, ProcessGroup* world) {
  const TrainingConfig& t = c.training;
  FORGE_CHECK(warmup_steps >= 0 && warmup_steps < t.steps, "bench: {} warm-up steps of {}", warmup_steps, t.steps);
  const auto start = std::chrono::steady_clock::now();
  BenchResult r;
  r.model = c.model.name;
  r.precision = c.precision.compute_dtype;
  r.fp8 = c.precision.fp8;
  // Said only where it changes something: a MoE model in FP8 with its routed experts in bf16.
  r.fp8_routed_experts = c.precision.fp8_routed_experts || !c.model.moe() || c.precision.fp8 == "none";
  if (c.precision.fp8 != "none") r.fp8_filter_fqns = c.precision.fp8_filter_fqns;  // NOTE [FP8 filter]
  r.fp8_weight_gradient = c.precision.fp8_weight_gradient || c.precision.fp8 == "none";
  r.micro_batch = t.local_batch_size;
  r.seq_len = t.seq_len;
  r.grad_accum = t.gradient_accumulation_steps;
  r.global_batch = t.global_batch_size;
  r.n_gpus = c.parallelism.data_parallel_shard_degree * c.parallelism.data_parallel_replicate_degree;
  r.parallelism = r.n_gpus > 1 ? fmt::format("fsdp {}", r.n_gpus) : "single";
  r.activation_checkpoint = c.activation_checkpoint.mode;
  r.args = args;
  r.device_name = accelerator_name();
  r.gpu_architecture = accelerator_architecture();
  r.config = nlohmann::json::object();
  r.warmup_steps = warmup_steps;
  r.measured_steps = t.steps - warmup_steps;

  reset_device_memory_peak();
  if (!c.flux.model.empty()) {
    run_flux_bench(c, r, world);
    r.peak_memory_bytes = static_cast<int64_t>(device_memory_peak());
    r.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return r;
  }
  catching_failures(r, [&] {
    TrainResult run;
    {
      Trainer trainer(c, resolved_yaml, world);
      trainer.show_progress(false);  // forge bench shows the sweep's
      run = trainer.run();
    }
    std::vector<double> measured(run.step_seconds.begin() + warmup_steps, run.step_seconds.end());
    r.step_time_median_s = median(measured).value();
    r.step_time_min_s = *std::min_element(measured.begin(), measured.end());
    r.step_time_max_s = *std::max_element(measured.begin(), measured.end());
    const double tokens_per_step = static_cast<double>(t.global_batch_size * t.seq_len);
    r.tokens_per_s_per_gpu = tokens_per_step / r.step_time_median_s / static_cast<double>(r.n_gpus);
    r.tflops_per_gpu = r.tokens_per_s_per_gpu * training_flops_per_token(c.model, c.lora, t.seq_len) / 1e12;
    if (const auto peak = peak_tflops(r.device_name)) r.mfu = r.tflops_per_gpu / *peak;
    if (const auto peak = peak_fp8_tflops(r.device_name); peak && r.fp8 != "none")
      r.mfu_fp8 = r.tflops_per_gpu / *peak;
  });
  r.peak_memory_bytes = static_cast<int64_t>(device_memory_peak());
  r.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return r;
}

int64_t find_max_micro_batch(const std::function<bool(int64_t)>& fits, int64_t limit) {
  int64_t good = 0, bad = limit + 1;  // largest size known to fit, smallest known not to
  for (int64_t mb = 1; mb <= limit; mb *= 2) {
    if (!fits(mb)) {
      bad = mb;
      break;
    }
    good = mb;
  }
  while (bad - good > 1) {
    const int64_t mid = good + (bad - good) / 2;
    (fits(mid) ? good : bad) = mid;
  }
  return good;
}

}  // namespace forge
