// NCCL bus bandwidth for preflight, the two collectives FSDP runs every step: all-reduce
// (and its halves, reduce-scatter of gradients) and all-gather (of parameters).
//
// One process drives every local GPU, as nccl-tests does with -g: ncclCommInitAll makes a
// communicator per GPU, and each collective is one ncclGroupStart/ncclGroupEnd around
// every GPU's call, so NCCL launches them together instead of waiting for a peer that
// this thread has not reached yet. Each GPU has its own stream; a collective's time is
// the slowest GPU's (NOTE [Preflight timing]). Sizes follow nccl-tests: all-reduce of a
// `bytes` buffer on each GPU, all-gather into a `bytes` buffer on each GPU (bytes / n sent
// by each), out of place, bf16; bus bandwidth as bus_bandwidth.h.
#include <nccl.h>

#include <memory>
#include <numeric>
#include <vector>

#include "bench/bus_bandwidth.h"
#include "bench/cuda/device_buffer.h"
#include "bench/cuda/event_timing.h"
#include "bench/preflight_measure.h"
#include "kernels/cuda/cuda_check.h"

#define NCCL_CHECK(expr)                                                                                      \
  do {                                                                                                        \
    ncclResult_t forge_nccl_status = (expr);                                                                  \
    if (forge_nccl_status != ncclSuccess)                                                                     \
      ::forge::throw_error(__FILE__, __LINE__, fmt::format("{}: {}", #expr, ncclGetErrorString(forge_nccl_status))); \
  } while (0)

namespace forge {
namespace {

using bench_cuda::DeviceBuffer;

// The communicators, streams and buffers of every GPU, released together.
struct Participants {
  std::vector<ncclComm_t> comms;
  std::vector<cudaStream_t> streams;
  std::vector<DeviceBuffer> send, receive;

  ~Participants() {
    for (size_t i = 0; i < streams.size(); ++i) {
      cudaSetDevice(static_cast<int>(i));
      cudaStreamDestroy(streams[i]);
    }
    for (ncclComm_t comm : comms) {
      if (comm) ncclCommDestroy(comm);
    }
  }
};

}  // namespace

CollectiveBandwidth measure_nccl_bus_bandwidth(int n_gpus, size_t bytes) {
  FORGE_CHECK(n_gpus >= 2, "collectives need at least 2 GPUs, got {}", n_gpus);
  const size_t count = bytes / 2;  // bf16 elements
  const size_t shard = count / static_cast<size_t>(n_gpus);
  FORGE_CHECK(shard > 0, "{} bytes cannot be sharded over {} GPUs", bytes, n_gpus);

  Participants p;
  std::vector<int> devices(static_cast<size_t>(n_gpus));
  std::iota(devices.begin(), devices.end(), 0);
  p.comms.assign(devices.size(), nullptr);
  NCCL_CHECK(ncclCommInitAll(p.comms.data(), n_gpus, devices.data()));
  std::vector<bench_cuda::TimedStream> timed;
  for (int gpu : devices) {
    CUDA_CHECK(cudaSetDevice(gpu));
    cudaStream_t stream = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    p.streams.push_back(stream);
    timed.push_back({gpu, stream});
    p.send.emplace_back(gpu, bytes);
    p.receive.emplace_back(gpu, bytes);
    CUDA_CHECK(cudaMemset(p.send.back().get(), 0, bytes));
  }

  CollectiveBandwidth result;
  const double allreduce_seconds = bench_cuda::median_call_seconds(timed, [&] {
    NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < devices.size(); ++i) {
      NCCL_CHECK(ncclAllReduce(p.send[i].get(), p.receive[i].get(), count, ncclBfloat16, ncclSum, p.comms[i],
                               p.streams[i]));
    }
    NCCL_CHECK(ncclGroupEnd());
  });
  result.allreduce_bus_gbps = allreduce_bus_bandwidth(static_cast<double>(count * 2), allreduce_seconds, n_gpus) / 1e9;

  const double allgather_seconds = bench_cuda::median_call_seconds(timed, [&] {
    NCCL_CHECK(ncclGroupStart());
    for (size_t i = 0; i < devices.size(); ++i) {
      NCCL_CHECK(ncclAllGather(p.send[i].get(), p.receive[i].get(), shard, ncclBfloat16, p.comms[i], p.streams[i]));
    }
    NCCL_CHECK(ncclGroupEnd());
  });
  result.allgather_bus_gbps =
      allgather_bus_bandwidth(static_cast<double>(shard * 2 * devices.size()), allgather_seconds, n_gpus) / 1e9;
  return result;
}

}  // namespace forge
