// forge bench's engine: one experiment run for warm-up plus measured steps, turned into a
// BenchResult; and the search for the largest micro-batch that fits.
//
// NOTE [What a benchmark run is]
// The experiment runs through the Trainer exactly as `forge train` would; the bench
// command resolves it with what a benchmark must not depend on switched off: data.source
// mock (random tokens, as Megatron's --mock-data), no evaluation, no checkpoints, a
// console line only on the first and last step, training.steps = warm-up + measured. The
// first warm-up steps (first-use costs: cuDNN graph builds, GEMM algorithm choice,
// allocator growth) are dropped; the figures are over the measured steps: median step
// time (min and max as the spread), tokens/s/GPU and model TFLOP/s/GPU from the median,
// MFU from the device's dense bf16 peak (../shared/PERF.md). Peak memory is the
// high-water mark of forge's device allocator over the whole run. A config that does not
// fit (the memory check or an allocation) is a result with status "oom", any other error
// one with status "failed": neither ends a sweep.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "bench/bench_result.h"
#include "train/experiment.h"

#include "distributed/process_group.h"

namespace forge {

// config: the resolved experiment (training.steps = warmup_steps + measured steps);
// resolved_yaml: the same as saved in the run directory; args: the overrides that define
// this run, for the reports. world: the ranks' process group under a launcher (one for
// the whole sweep: a rendezvous per run would race the previous run's teardown), else null.
BenchResult run_bench(const ExperimentConfig& config, const std::string& resolved_yaml, const std::string& args,
                      int64_t warmup_steps, ProcessGroup* world = nullptr);

// The largest micro-batch in [1, limit] for which fits(micro_batch) holds, assuming it
// holds for every size below one that fits: doubling from 1 until a size does not fit,
// then bisecting. 0 when not even 1 fits.
int64_t find_max_micro_batch(const std::function<bool(int64_t)>& fits, int64_t limit = 1024);

}  // namespace forge
