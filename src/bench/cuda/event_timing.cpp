// median_call_seconds; see NOTE [Preflight timing] in event_timing.h.
#include "bench/cuda/event_timing.h"

#include <algorithm>
#include <chrono>
#include <memory>

#include "bench/median.h"
#include "kernels/cuda/cuda_check.h"

namespace forge::bench_cuda {
namespace {

void synchronize(const std::vector<TimedStream>& streams) {
  for (const TimedStream& s : streams) {
    CUDA_CHECK(cudaSetDevice(s.device));
    CUDA_CHECK(cudaStreamSynchronize(s.stream));
  }
}

// Events for every iteration's start and stop on one stream's device.
struct StreamEvents {
  int device;
  std::vector<cudaEvent_t> start, stop;

  explicit StreamEvents(int device_index) : device(device_index), start(kIterations), stop(kIterations) {
    CUDA_CHECK(cudaSetDevice(device));
    for (int i = 0; i < kIterations; ++i) {
      CUDA_CHECK(cudaEventCreate(&start[i]));
      CUDA_CHECK(cudaEventCreate(&stop[i]));
    }
  }
  ~StreamEvents() {
    cudaSetDevice(device);
    for (int i = 0; i < kIterations; ++i) {
      if (start[i]) cudaEventDestroy(start[i]);
      if (stop[i]) cudaEventDestroy(stop[i]);
    }
  }
  StreamEvents(const StreamEvents&) = delete;
  StreamEvents& operator=(const StreamEvents&) = delete;
};

}  // namespace

double median_call_seconds(const std::vector<TimedStream>& streams, const std::function<void()>& launch) {
  using Clock = std::chrono::steady_clock;
  const auto warmup_start = Clock::now();
  do {
    launch();
    synchronize(streams);
  } while (std::chrono::duration<double>(Clock::now() - warmup_start).count() < kWarmupSeconds);

  std::vector<std::unique_ptr<StreamEvents>> events;
  for (const TimedStream& s : streams) events.push_back(std::make_unique<StreamEvents>(s.device));
  for (int i = 0; i < kIterations; ++i) {
    for (size_t s = 0; s < streams.size(); ++s) {
      CUDA_CHECK(cudaSetDevice(streams[s].device));
      CUDA_CHECK(cudaEventRecord(events[s]->start[i], streams[s].stream));
    }
    launch();
    for (size_t s = 0; s < streams.size(); ++s) {
      CUDA_CHECK(cudaSetDevice(streams[s].device));
      CUDA_CHECK(cudaEventRecord(events[s]->stop[i], streams[s].stream));
    }
  }
  synchronize(streams);

  std::vector<double> seconds(kIterations, 0.0);
  for (size_t s = 0; s < streams.size(); ++s) {
    for (int i = 0; i < kIterations; ++i) {
      float ms = 0;
      CUDA_CHECK(cudaEventElapsedTime(&ms, events[s]->start[i], events[s]->stop[i]));
      seconds[i] = std::max(seconds[i], 1e-3 * ms);
    }
  }
  return median(seconds).value();
}

}  // namespace forge::bench_cuda
