// NCCL behind ProcessGroup. The communicator is created non-blocking, so no NCCL call
// can block the calling thread: a call may instead return ncclInProgress, and settle()
// polls ncclCommGetAsyncError until NCCL is done with it. What can still wait forever is
// the GPU, a collective kernel spinning on a peer that never comes; the watchdog thread
// watches for exactly that (NOTE [NCCL watchdog] in process_group.h).
//
// Locking: comm_mu_ is held for every NCCL call on comm_ (each returns promptly, being
// non-blocking) and while the watchdog takes comm_ away to abort it, so no thread ever
// calls NCCL on a communicator another thread is destroying.
#include "distributed/cuda/nccl_process_group.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <memory>
#include <utility>

#include "core/error.h"
#include "core/log.h"
#include "distributed/flight_recorder.h"
#include "distributed/point_to_point.h"
#include "distributed/tcp_store.h"
#include "kernels/cuda/cuda_check.h"

namespace forge {
namespace {

using namespace std::chrono_literals;

constexpr auto kWatchdogInterval = 10ms;
constexpr auto kHostPollInterval = 100us;
// ncclCommAbort sets NCCL's abort flag at once (the kernels waiting on peers quit), but it
// and ncclCommDestroy then wait for NCCL's proxy thread, which stays until every peer rank
// connected to it has closed its end: teardown waits for the other ranks. So both run on
// a helper thread and are waited for a bounded time; past it, the failure is reported
// anyway and the helper thread is left to finish when the peers go (or the process ends).
constexpr auto kAbortWait = 10s;

// Runs `call` on a detached thread; true when it returned within `limit`.
bool returns_within(std::function<void()> call, std::chrono::milliseconds limit) {
  auto finished = std::make_shared<std::promise<void>>();
  std::future<void> done = finished->get_future();
  std::thread([call = std::move(call), finished] {
    call();
    finished->set_value();
  }).detach();
  return done.wait_for(limit) == std::future_status::ready;
}

ncclDataType_t nccl_type(DType dtype) { return dtype == DType::BF16 ? ncclBfloat16 : ncclFloat32; }
ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::Avg ? ncclAvg : op == ReduceOp::Max ? ncclMax : ncclSum; }

std::string seconds(std::chrono::milliseconds ms) { return fmt::format("{:g} s", ms.count() / 1000.0); }

// Every group with a communicator, for abort_all_communicators().
std::mutex g_live_mu;
std::vector<NcclProcessGroup*> g_live;

// Every communicator forge makes, split ones included, is non-blocking (NOTE [NCCL watchdog]).
ncclConfig_t nonblocking_config() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}

}  // namespace

NcclProcessGroup::NcclProcessGroup(const LaunchEnv& env, const ProcessGroupOptions& options)
    : NcclProcessGroup(connect(env, options), env.rank, env.world_size, env.local_rank, options) {}

NcclProcessGroup::NcclProcessGroup(Connected connected, int rank, int world_size, int device,
                                   const ProcessGroupOptions& options)
    : NcclProcessGroup(connected.comm, rank, world_size, device, options, "", std::move(connected.heartbeat)) {}

NcclProcessGroup::Connected NcclProcessGroup::connect(const LaunchEnv& env, const ProcessGroupOptions& options) {
  const int rank = env.rank;
  const int device = env.local_rank;
  int devices = 0;
  CUDA_CHECK(cudaGetDeviceCount(&devices));
  if (device >= devices)
    FORGE_FAIL(
        "{}: local rank {} needs GPU {}, but this node shows {} GPU(s): start at most {} rank(s) per node, "
        "or check CUDA_VISIBLE_DEVICES",
        describe(env), device, device, devices, devices);
  CUDA_CHECK(cudaSetDevice(device));

  ncclUniqueId id{};
  std::shared_ptr<Heartbeat> heartbeat;
  {
    TcpStore store(env, options.rendezvous_timeout);
    if (rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) FORGE_FAIL("rank 0: ncclGetUniqueId: {}", ncclGetErrorString(r));
    }
    store.broadcast({reinterpret_cast<uint8_t*>(id.internal), sizeof(id.internal)});
    if (options.heartbeat_timeout.count() > 0)
      heartbeat = std::make_shared<Heartbeat>(
          store, env, HeartbeatOptions{options.heartbeat_timeout, options.rendezvous_timeout, abort_all_communicators});
  }

  ncclConfig_t config = nonblocking_config();
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, env.world_size, id, rank, &config);
  const auto deadline = Clock::now() + options.rendezvous_timeout;
  while (r == ncclInProgress && Clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
    ncclCommGetAsyncError(comm, &r);
  }
  if (r != ncclSuccess) {
    const std::string detail = comm ? ncclGetLastError(comm) : "";
    if (comm) ncclCommAbort(comm);
    if (r == ncclInProgress)
      FORGE_FAIL(
          "rank {} (GPU {}): NCCL communicator setup did not finish within {} (did another rank fail to "
          "start NCCL?)",
          rank, device, seconds(options.rendezvous_timeout));
    FORGE_FAIL("rank {} (GPU {}): NCCL communicator setup failed: {} {}", rank, device, ncclGetErrorString(r),
               detail);
  }
  return {comm, std::move(heartbeat)};
}

void NcclProcessGroup::abort_all_communicators() {
  std::lock_guard live(g_live_mu);
  for (NcclProcessGroup* g : g_live) {
    ncclComm_t comm = nullptr;
    {
      std::lock_guard lock(g->comm_mu_);
      comm = std::exchange(g->comm_, nullptr);
    }
    if (comm && !returns_within([comm] { ncclCommAbort(comm); }, kAbortWait))
      log_error("rank {}: ncclCommAbort has not returned after {}; going on without it", g->rank_,
                seconds(kAbortWait));
  }
}

NcclProcessGroup::NcclProcessGroup(ncclComm_t comm, int rank, int world_size, int device,
                                   const ProcessGroupOptions& options, std::string label,
                                   std::shared_ptr<Heartbeat> heartbeat)
    : rank_(rank),
      world_size_(world_size),
      device_(device),
      label_(std::move(label)),
      options_(options),
      heartbeat_(std::move(heartbeat)) {
  if (!options_.on_failure && heartbeat_) {
    // Rank 0 tells every rank (NOTE [Failure detection]); this process then ends.
    options_.on_failure = [h = heartbeat_.get()](const std::string& message) { h->fail(message); };
  }
  if (!options_.on_failure) {
    options_.on_failure = [](const std::string&) {
      std::fflush(nullptr);
      std::_Exit(1);  // no static destructors: other threads may be inside CUDA calls
    };
  }
  try {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaMalloc(&barrier_value_, sizeof(float)));
    CUDA_CHECK(cudaMemset(barrier_value_, 0, sizeof(float)));
  } catch (const Error&) {
    cudaFree(barrier_value_);
    ncclCommAbort(comm);
    throw;
  }
  comm_ = comm;
  {
    std::lock_guard live(g_live_mu);
    g_live.push_back(this);
  }
  watchdog_ = std::thread(&NcclProcessGroup::watchdog_loop, this);
}

NcclProcessGroup::~NcclProcessGroup() {
  try {
    destroy();
  } catch (const Error&) {
    // destroy() already reported the failure through on_failure.
  }
}

void NcclProcessGroup::check_usable(const char* what) {
  FORGE_CHECK(!destroyed_, "{} on a process group after destroy()", what);
  if (failed_) throw Error(failure_);
}

std::string NcclProcessGroup::settle(ncclResult_t result, const std::string& what, Clock::time_point deadline,
                                     std::unique_lock<std::mutex>& comm_lock) {
  while (result == ncclInProgress) {
    if (Clock::now() >= deadline)
      return fmt::format(
          "{} did not complete within {} of being called (NCCL was still setting it up, which for a first "
          "collective includes connecting to the peers: a peer rank died, hangs, or is in another collective)",
          what, seconds(options_.collective_timeout));
    comm_lock.unlock();
    std::this_thread::sleep_for(kHostPollInterval);
    comm_lock.lock();
    if (!comm_) return fmt::format("{}: the communicator was aborted", what);
    ncclCommGetAsyncError(comm_, &result);
  }
  if (result != ncclSuccess)
    return fmt::format("{}: {} ({})", what, ncclGetErrorString(result), ncclGetLastError(comm_));
  return "";
}

template <typename Call>
void NcclProcessGroup::enqueue(std::string what, CudaStream stream, Call&& call) {
  cudaEvent_t done = nullptr;
  {
    std::lock_guard lock(flight_mu_);
    if (!spare_events_.empty()) {
      done = spare_events_.back();
      spare_events_.pop_back();
    }
  }
  if (!done) CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  std::string error;
  {
    std::unique_lock lock(comm_mu_);
    if (!comm_) {
      lock.unlock();
      cudaEventDestroy(done);
      check_usable(what.c_str());
      FORGE_FAIL("{}: the communicator is gone", what);
    }
    error = settle(call(comm_), what, Clock::now() + options_.collective_timeout, lock);
  }
  if (!error.empty()) {
    cudaEventDestroy(done);
    fail(error);
  }
  CUDA_CHECK(cudaEventRecord(done, stream));
  const uint64_t record = flight_record_start(label_.empty() ? "the world" : "NCCL group" + label_, what);
  std::lock_guard lock(flight_mu_);
  in_flight_.push_back({done, std::move(what), Clock::now(), record});
}

void NcclProcessGroup::all_reduce(const Tensor& tensor, ReduceOp op, CudaStream stream) {
  check_usable("all_reduce");
  check_all_reduce(tensor, Device::CUDA);
  if (tensor.numel() == 0) return;
  const std::string what = fmt::format("all_reduce #{} ({}, {} elements, {})", ++collectives_,
                                       dtype_name(tensor.dtype()), tensor.numel(), reduce_op_name(op));
  enqueue(what, stream, [&](ncclComm_t comm) {
    return ncclAllReduce(tensor.raw(), tensor.raw(), static_cast<size_t>(tensor.numel()), nccl_type(tensor.dtype()),
                         nccl_op(op), comm, stream);
  });
}

void NcclProcessGroup::reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op, CudaStream stream) {
  check_usable("reduce_scatter");
  check_reduce_scatter(output, input, world_size_, Device::CUDA);
  if (output.numel() == 0) return;
  const std::string what = fmt::format("reduce_scatter #{} ({}, {} elements per rank, {})", ++collectives_,
                                       dtype_name(output.dtype()), output.numel(), reduce_op_name(op));
  enqueue(what, stream, [&](ncclComm_t comm) {
    return ncclReduceScatter(input.raw(), output.raw(), static_cast<size_t>(output.numel()), nccl_type(output.dtype()),
                             nccl_op(op), comm, stream);
  });
}

void NcclProcessGroup::all_gather(const Tensor& output, const Tensor& input, CudaStream stream) {
  check_usable("all_gather");
  check_all_gather(output, input, world_size_, Device::CUDA);
  if (input.numel() == 0) return;
  const std::string what = fmt::format("all_gather #{} ({}, {} elements per rank)", ++collectives_,
                                       dtype_name(input.dtype()), input.numel());
  enqueue(what, stream, [&](ncclComm_t comm) {
    // Nothing is reduced: U8 (FP8 codes, NOTE [FP8 all-gather] in distributed/fsdp.h) moves as bytes.
    if (input.dtype() == DType::U8)
      return ncclAllGather(input.raw(), output.raw(), static_cast<size_t>(input.numel()), ncclUint8, comm, stream);
    return ncclAllGather(input.raw(), output.raw(), static_cast<size_t>(input.numel()), nccl_type(input.dtype()), comm,
                         stream);
  });
}

void NcclProcessGroup::all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                                  const std::vector<int64_t>& send_counts, CudaStream stream) {
  check_usable("all_to_all");
  check_all_to_all(output, recv_counts, input, send_counts, world_size_, Device::CUDA);
  // Rows move as bytes (ncclUint8): nothing is reduced, so any dtype works, int32 indices
  // included, which nccl_type() does not map.
  const size_t row_bytes = static_cast<size_t>(row_elements(input)) * dtype_size(input.dtype());
  int64_t sent = 0;
  int64_t received = 0;
  for (int r = 0; r < world_size_; ++r) {
    sent += send_counts[r];
    received += recv_counts[r];
  }
  // Every rank counts the call, even one with nothing to move, so that the numbers of the
  // flight records agree across ranks.
  const std::string what = fmt::format("all_to_all #{} ({}, rows of {} elements, {} rows sent, {} received)",
                                       ++collectives_, dtype_name(input.dtype()), row_elements(input), sent, received);
  enqueue(what, stream, [&](ncclComm_t comm) {
    ncclResult_t result = ncclGroupStart();
    if (result != ncclSuccess) return result;
    const auto* in = static_cast<const uint8_t*>(input.raw());
    auto* out = static_cast<uint8_t*>(output.raw());
    size_t send_at = 0;
    size_t recv_at = 0;
    for (int r = 0; r < world_size_ && result == ncclSuccess; ++r) {
      const size_t send_bytes = static_cast<size_t>(send_counts[r]) * row_bytes;
      const size_t recv_bytes = static_cast<size_t>(recv_counts[r]) * row_bytes;
      if (send_bytes > 0) result = ncclSend(in + send_at, send_bytes, ncclUint8, r, comm, stream);
      if (result == ncclSuccess && recv_bytes > 0)
        result = ncclRecv(out + recv_at, recv_bytes, ncclUint8, r, comm, stream);
      send_at += send_bytes;
      recv_at += recv_bytes;
    }
    // The group is ended whatever happened inside it; its result (ncclInProgress on a
    // non-blocking communicator) is what settle() waits on.
    const ncclResult_t end = ncclGroupEnd();
    return result != ncclSuccess ? result : end;
  });
}

void NcclProcessGroup::send_recv(const std::vector<PointToPoint>& ops, CudaStream stream) {
  check_usable("send_recv");
  check_send_recv(ops, world_size_, Device::CUDA);
  check_send_recv_to_self(ops, rank_);  // an unpaired send to itself would hang the group
  size_t sends = 0;
  size_t recvs = 0;
  uint64_t sent = 0;
  uint64_t received = 0;
  for (const PointToPoint& op : ops) {
    const bool send = op.kind == PointToPoint::Kind::Send;
    (send ? sends : recvs) += 1;
    (send ? sent : received) += op.tensor.nbytes();
  }
  // Every rank counts the call, even one with nothing to move (which enqueues nothing),
  // so that the numbers of the flight records agree across ranks.
  const std::string what = fmt::format("send_recv #{} ({} sends of {} bytes, {} receives of {} bytes)",
                                       ++collectives_, sends, sent, recvs, received);
  if (sent == 0 && received == 0) return;
  enqueue(what, stream, [&](ncclComm_t comm) {
    ncclResult_t result = ncclGroupStart();
    if (result != ncclSuccess) return result;
    // Bytes (ncclUint8), in the order listed: NCCL matches the sends and receives between
    // two ranks in the order they are issued, as NOTE [Point-to-point] pairs them.
    for (size_t i = 0; i < ops.size() && result == ncclSuccess; ++i) {
      const PointToPoint& op = ops[i];
      const size_t bytes = op.tensor.nbytes();
      if (bytes == 0) continue;
      result = op.kind == PointToPoint::Kind::Send
                   ? ncclSend(op.tensor.raw(), bytes, ncclUint8, op.peer, comm, stream)
                   : ncclRecv(op.tensor.raw(), bytes, ncclUint8, op.peer, comm, stream);
    }
    // The group is ended whatever happened inside it; its result (ncclInProgress on a
    // non-blocking communicator) is what settle() waits on.
    const ncclResult_t end = ncclGroupEnd();
    return result != ncclSuccess ? result : end;
  });
}

void NcclProcessGroup::barrier() {
  check_usable("barrier");
  // On the legacy default stream, which waits for the work of every other (blocking)
  // stream, so the barrier also orders after collectives enqueued elsewhere.
  enqueue(fmt::format("barrier #{}", ++collectives_), nullptr, [&](ncclComm_t comm) {
    return ncclAllReduce(barrier_value_, barrier_value_, 1, ncclFloat32, ncclSum, comm, nullptr);
  });
  wait_all("barrier");
}

std::unique_ptr<ProcessGroup> NcclProcessGroup::split(int color, int key) {
  check_usable("split");
  check_split(color);
  const uint64_t number = ++collectives_;
  const std::string what = fmt::format("split #{} (color {}, key {})", number, color, key);
  // With a non-blocking parent, ncclCommSplit returns ncclInProgress and creates the child
  // on a thread of NCCL's: the parent's state stays ncclInProgress until then (settle()
  // waits for that, bounded like a collective), and NCCL writes the child's handle only
  // when done. The slot NCCL writes to is on the heap and left behind when the wait ends
  // early, as NCCL's thread may still write to it after the abort.
  auto* slot = new ncclComm_t(nullptr);
  ncclConfig_t config = nonblocking_config();
  std::string error;
  {
    std::unique_lock lock(comm_mu_);
    if (!comm_) {
      lock.unlock();
      delete slot;
      check_usable("split");
      FORGE_FAIL("{}: the communicator is gone", what);
    }
    const auto deadline = Clock::now() + options_.collective_timeout;
    error = settle(ncclCommSplit(comm_, color, key, slot, &config), what, deadline, lock);
    // NCCL stores the child's handle (atomically, with release order) when its
    // initialization job ends, which can be after the parent has left ncclInProgress: the
    // first try on 4 H200s (NCCL 2.28) found the slot still empty here. Wait for it.
    auto child_handle = [slot] { return std::atomic_ref<ncclComm_t>(*slot).load(std::memory_order_acquire); };
    while (error.empty() && !child_handle()) {
      if (Clock::now() >= deadline) {
        error = fmt::format("{}: NCCL had not created the new communicator within {} of the call", what,
                            seconds(options_.collective_timeout));
        break;
      }
      lock.unlock();
      std::this_thread::sleep_for(kHostPollInterval);
      lock.lock();
    }
    if (error.empty()) {
      // Newer NCCL reports the child's setup on the parent (waited for above); older ones on
      // the child itself: wait for that too, within the same deadline.
      ncclResult_t state = ncclInProgress;
      while (true) {
        const ncclResult_t query = ncclCommGetAsyncError(child_handle(), &state);
        if (query != ncclSuccess) state = query;
        if (state != ncclInProgress || Clock::now() >= deadline) break;
        lock.unlock();
        std::this_thread::sleep_for(kHostPollInterval);
        lock.lock();
      }
      if (state != ncclSuccess) {
        error = state == ncclInProgress
                    ? fmt::format("{}: the new communicator was not ready within {} of the call", what,
                                  seconds(options_.collective_timeout))
                    : fmt::format("{}: the new communicator failed: {} ({})", what, ncclGetErrorString(state),
                                  ncclGetLastError(child_handle()));
      }
    }
  }
  if (error.empty() && failed_) error = fmt::format("{}: the communicator was aborted meanwhile", what);
  if (!error.empty()) {
    if (ncclComm_t child = std::atomic_ref<ncclComm_t>(*slot).load(std::memory_order_acquire))
      if (!returns_within([child] { ncclCommAbort(child); }, kAbortWait))
        log_error("rank {}: ncclCommAbort of the split's communicator has not returned after {}; going on without it",
                  rank_, seconds(kAbortWait));
    fail(error);  // the parent too: a rank whose peers cannot split with it cannot go on
  }
  const ncclComm_t child = *slot;
  delete slot;
  int child_rank = 0;
  int child_size = 0;
  if (ncclCommUserRank(child, &child_rank) != ncclSuccess || ncclCommCount(child, &child_size) != ncclSuccess) {
    ncclCommAbort(child);
    fail(fmt::format("{}: NCCL cannot say this rank's place in the new communicator", what));
  }
  return std::unique_ptr<ProcessGroup>(new NcclProcessGroup(child, child_rank, child_size, device_, options_,
                                                            fmt::format(", split #{} color {}", number, color),
                                                            heartbeat_));
}

void NcclProcessGroup::retire_completed() {
  std::string problem;
  {
    std::lock_guard lock(flight_mu_);
    const auto now = Clock::now();
    for (size_t i = 0; i < in_flight_.size();) {
      const cudaError_t state = cudaEventQuery(in_flight_[i].done);
      if (state == cudaSuccess) {
        flight_record_end(in_flight_[i].record);
        spare_events_.push_back(in_flight_[i].done);
        in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
        continue;
      }
      if (state != cudaErrorNotReady) {
        problem = fmt::format("{}: CUDA error {}", in_flight_[i].what, cudaGetErrorString(state));
        break;
      }
      if (now - in_flight_[i].enqueued > options_.collective_timeout) {
        problem = fmt::format(
            "{} did not complete within {} of being enqueued (a peer rank died, hangs, or is in "
            "another collective)",
            in_flight_[i].what, seconds(options_.collective_timeout));
        break;
      }
      ++i;
    }
  }
  if (!problem.empty()) fail(problem);
}

void NcclProcessGroup::wait_all(const char* what) {
  while (true) {
    check_usable(what);
    retire_completed();
    {
      std::lock_guard lock(flight_mu_);
      if (in_flight_.empty()) return;
    }
    std::this_thread::sleep_for(kHostPollInterval);
  }
}

void NcclProcessGroup::watchdog_loop() {
  cudaSetDevice(device_);
  while (!stop_watchdog_ && !failed_) {
    std::this_thread::sleep_for(kWatchdogInterval);
    try {
      std::string error;
      {
        std::lock_guard lock(comm_mu_);
        if (!comm_) continue;
        ncclResult_t state = ncclSuccess;
        ncclCommGetAsyncError(comm_, &state);
        if (state != ncclSuccess && state != ncclInProgress)
          error = fmt::format("NCCL reported {} ({})", ncclGetErrorString(state), ncclGetLastError(comm_));
      }
      if (!error.empty()) fail(error);
      retire_completed();
    } catch (const Error&) {
      return;  // fail() has reported it
    }
  }
}

void NcclProcessGroup::fail(const std::string& cause) {
  std::call_once(failure_once_, [&] {
    failure_ = fmt::format("rank {} of {}{} (GPU {}): {}", rank_, world_size_, label_, device_, cause);
    failed_ = true;
    log_error("{}; aborting the NCCL communicator\nflight record of rank {}:{}", failure_, rank_,
              flight_record_text());
    ncclComm_t comm = nullptr;
    {
      std::lock_guard lock(comm_mu_);
      comm = std::exchange(comm_, nullptr);
    }
    if (comm && !returns_within([comm] { ncclCommAbort(comm); }, kAbortWait))
      log_error("rank {}: ncclCommAbort has not returned after {} (it waits for the peer ranks to end their "
                "communicators too); going on without it",
                rank_, seconds(kAbortWait));
    options_.on_failure(failure_);
  });
  throw Error(failure_);
}

void NcclProcessGroup::destroy() {
  if (destroyed_) return;
  // Whatever happens below, the watchdog stops and the CUDA resources are released.
  struct Release {
    NcclProcessGroup& g;
    ~Release() {
      {
        std::lock_guard live(g_live_mu);
        std::erase(g_live, &g);
      }
      g.stop_watchdog_ = true;
      if (g.watchdog_.joinable()) g.watchdog_.join();
      std::lock_guard lock(g.flight_mu_);
      // cudaFree waits for the whole GPU: only once the collectives still in flight (the
      // aborted ones, after a failure) have ended, and that wait is bounded too.
      const auto deadline = Clock::now() + kAbortWait;
      bool idle = false;
      while (!(idle = std::all_of(g.in_flight_.begin(), g.in_flight_.end(),
                                  [](const InFlight& f) { return cudaEventQuery(f.done) != cudaErrorNotReady; })) &&
             Clock::now() < deadline)
        std::this_thread::sleep_for(kHostPollInterval);
      for (const InFlight& f : g.in_flight_) cudaEventDestroy(f.done);
      for (cudaEvent_t e : g.spare_events_) cudaEventDestroy(e);
      g.in_flight_.clear();
      g.spare_events_.clear();
      if (idle) {
        cudaFree(g.barrier_value_);
      } else {
        log_error("rank {}: collectives still running {} after the abort; their memory is left allocated", g.rank_,
                  seconds(kAbortWait));
      }
      g.barrier_value_ = nullptr;
      g.destroyed_ = true;
    }
  } release{*this};
  if (failed_) return;
  wait_all("destroy");
  std::string error;
  {
    std::unique_lock lock(comm_mu_);
    if (comm_) {
      error = settle(ncclCommFinalize(comm_), "ncclCommFinalize", Clock::now() + options_.collective_timeout, lock);
    }
  }
  if (!error.empty()) fail(error);
  ncclComm_t comm = nullptr;
  {
    std::lock_guard lock(comm_mu_);
    comm = std::exchange(comm_, nullptr);
  }
  if (comm && !returns_within([comm] { ncclCommDestroy(comm); }, options_.collective_timeout)) {
    const std::string cause = fmt::format(
        "ncclCommDestroy did not return within {} (NCCL's teardown waits for every peer rank to destroy or abort "
        "its communicator too: a peer rank died, hangs, or has not reached its destroy)",
        seconds(options_.collective_timeout));
    std::call_once(failure_once_, [&] {
      failure_ = fmt::format("rank {} of {}{} (GPU {}): {}", rank_, world_size_, label_, device_, cause);
      failed_ = true;
      log_error("{}", failure_);
      options_.on_failure(failure_);
    });
    throw Error(failure_);
  }
}

}  // namespace forge
