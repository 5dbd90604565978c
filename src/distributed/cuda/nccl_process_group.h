// ProcessGroup over NCCL: one GPU per rank, a non-blocking communicator and a watchdog
// thread (NOTE [NCCL watchdog] in process_group.h). Built only with FORGE_CUDA; reached
// through create_process_group().
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "distributed/heartbeat.h"
#include "distributed/process_group.h"

namespace forge {

class NcclProcessGroup final : public ProcessGroup {
 public:
  // Meets the other ranks (TCP rendezvous, NCCL id from rank 0) and creates the
  // communicator on GPU env.local_rank, which becomes the calling thread's device.
  NcclProcessGroup(const LaunchEnv& env, const ProcessGroupOptions& options);
  ~NcclProcessGroup() override;
  NcclProcessGroup(const NcclProcessGroup&) = delete;
  NcclProcessGroup& operator=(const NcclProcessGroup&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }

  void all_reduce(const Tensor& tensor, ReduceOp op, CudaStream stream) override;
  void reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op, CudaStream stream) override;
  void all_gather(const Tensor& output, const Tensor& input, CudaStream stream) override;
  // One ncclSend/ncclRecv per peer with rows to move (self included), in one NCCL group.
  void all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                  const std::vector<int64_t>& send_counts, CudaStream stream) override;
  // One ncclSend/ncclRecv per op with bytes to move (ncclUint8), in one NCCL group.
  void send_recv(const std::vector<PointToPoint>& ops, CudaStream stream) override;
  void barrier() override;
  void destroy() override;
  // ncclCommSplit of this communicator, waited for as a collective is (NOTE [NCCL
  // watchdog]): the new group has its own communicator, watchdog and failure state.
  std::unique_ptr<ProcessGroup> split(int color, int key) override;

 private:
  using Clock = std::chrono::steady_clock;

  // Takes over `comm`, a ready communicator whose rank `rank` of `world_size` this process
  // is on GPU `device`: the setup both constructors share (the barrier's buffer, the
  // watchdog). Aborts `comm` when it throws. `label` names the group in messages.
  // `heartbeat` (shared by the world and its splits, may be null): a failure goes through
  // it (NOTE [Failure detection]).
  NcclProcessGroup(ncclComm_t comm, int rank, int world_size, int device, const ProcessGroupOptions& options,
                   std::string label, std::shared_ptr<Heartbeat> heartbeat);
  struct Connected;
  NcclProcessGroup(Connected connected, int rank, int world_size, int device, const ProcessGroupOptions& options);
  struct Connected {
    ncclComm_t comm;
    std::shared_ptr<Heartbeat> heartbeat;  // when options.heartbeat_timeout > 0
  };
  // The public constructor's part before that: the rendezvous, the heartbeat and the new
  // communicator.
  static Connected connect(const LaunchEnv& env, const ProcessGroupOptions& options);
  // Aborts the communicator of every live group (the heartbeat's last act before it ends
  // the process on another rank's failure), each waited for a bounded time.
  static void abort_all_communicators();

  // A collective enqueued and not yet seen complete.
  struct InFlight {
    cudaEvent_t done;
    std::string what;  // "all_reduce #12 (bf16, 4096 elements, sum)"
    Clock::time_point enqueued;
    uint64_t record;  // its flight record entry (flight_recorder.h)
  };

  // Runs one NCCL call on the communicator, waits out ncclInProgress, records the
  // completion event on `stream` and hands the collective to the watchdog.
  template <typename Call>
  void enqueue(std::string what, CudaStream stream, Call&& call);
  // Waits, with comm_mu_ held in `comm_lock` except while sleeping, until NCCL has left
  // ncclInProgress after a call that returned `result`. Returns "" on success, else what
  // went wrong (the caller releases the lock and fail()s with it).
  std::string settle(ncclResult_t result, const std::string& what, Clock::time_point deadline,
                     std::unique_lock<std::mutex>& comm_lock);
  // Drops the collectives whose events completed; fails on a timed-out one.
  void retire_completed();
  // Waits until every collective enqueued so far has completed (or throws the failure).
  void wait_all(const char* what);
  void watchdog_loop();
  // Aborts the communicator and reports `cause` once (NOTE [NCCL watchdog]); throws
  // the message to the caller when on_failure returns.
  [[noreturn]] void fail(const std::string& cause);
  void check_usable(const char* what);

  int rank_;
  int world_size_;
  int device_;
  std::string label_;  // "" for the world, ", split #1 color 0" for a group split from it
  ProcessGroupOptions options_;

  std::mutex comm_mu_;         // guards comm_: NCCL calls, and the abort
  ncclComm_t comm_ = nullptr;  // null once destroyed or aborted

  std::mutex flight_mu_;  // guards in_flight_, spare_events_
  std::vector<InFlight> in_flight_;
  std::vector<cudaEvent_t> spare_events_;
  uint64_t collectives_ = 0;

  std::once_flag failure_once_;
  std::atomic<bool> failed_{false};
  std::string failure_;  // written once, before failed_ is set

  float* barrier_value_ = nullptr;  // one float on the GPU, all-reduced by barrier()
  std::atomic<bool> stop_watchdog_{false};
  std::thread watchdog_;
  bool destroyed_ = false;
  std::shared_ptr<Heartbeat> heartbeat_;
};

}  // namespace forge
