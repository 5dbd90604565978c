// Timing GPU work with CUDA events, the way every preflight number is taken.
//
// NOTE [Preflight timing]
// A GPU idles at low clocks and ramps up under load, and the first call of a library
// routine pays for its set-up (heuristics, kernel loading, NCCL connections). So the work
// is first repeated, synchronized, for a fixed wall time (kWarmupSeconds) to bring the
// clocks up, then timed kIterations times, each call between two events on each stream
// taking part. A call's time is the longest of its streams (a collective ends when its
// slowest GPU does), and the result is the median call: robust to the odd call slowed by
// something else on the machine, where a mean is not.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

namespace forge::bench_cuda {

constexpr double kWarmupSeconds = 0.2;
constexpr int kIterations = 21;

struct TimedStream {
  int device;
  cudaStream_t stream;  // nullptr: the legacy default stream, where forge's ops run
};

// Median seconds per call of `launch`, which enqueues its work on `streams` without
// synchronizing.
double median_call_seconds(const std::vector<TimedStream>& streams, const std::function<void()>& launch);

}  // namespace forge::bench_cuda
