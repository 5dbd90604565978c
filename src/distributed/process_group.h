// The ranks of a job as one communicator: the collectives data-parallel training needs
// (all-reduce, reduce-scatter, all-gather) on whole tensors, the all-to-all of rows with
// variable counts that expert parallelism dispatches tokens with, batched point-to-point
// sends and receives for pipeline parallelism, and a barrier.
//
// NOTE [Process group]
// create_process_group() picks the implementation by device:
//  - CUDA: NCCL (cuda/nccl_process_group.cpp), one GPU per rank, GPU local_rank of the
//    node (it becomes this thread's current device). Rank 0 makes the NCCL unique id and
//    hands it out over the TCP rendezvous (tcp_store.h). Collectives are enqueued on the
//    caller's stream and return at once; fp32 and bf16 tensors, sum or average.
//  - CPU, one rank: the single-rank group, where every collective is the identity (or a
//    copy), so code written against ProcessGroup runs unchanged without a GPU.
//  - CPU, several ranks: every collective computed by rank 0 over the rendezvous's TCP
//    connections (cpu_process_group.h, NOTE [CPU process group]); for tests and the CPU
//    reference path, so that multi-rank code (FSDP) is tested in CI, which has no GPU.
// All tensors of one call are on the group's device, of one dtype, and contiguous (as
// every forge Tensor is); reduce_scatter's input and all_gather's output hold world_size
// equal chunks in rank order.
//
// split(color, key) makes groups of some of the ranks, as MPI_Comm_split and ncclCommSplit
// do (hybrid sharding: a shard group within a node, a replicate group across nodes).
// Every rank of the group calls it together, each with its color (>= 0) and key; each
// gets the group of the ranks that passed its color, ranked by key, ties broken by the
// rank in this group. The new group's collectives combine its ranks' tensors only; it is
// destroyed on its own and may outlive its parent. On NCCL it is a new communicator
// (ncclCommSplit) with its own watchdog; on the CPU it has TCP connections of its own,
// made within the split (NOTE [CPU process group]). Either way its collectives involve
// its ranks only: groups make their calls independently of the ranks outside them (as
// the stages of a pipeline do).
//
// NOTE [All-to-all]
// all_to_all(output, recv_counts, input, send_counts) exchanges rows (slices along dim 0;
// a row is the product of the other dims, the same width in `input` and `output`) between
// every pair of ranks of the group, as expert parallelism dispatches tokens to the ranks
// holding their experts and combines them back. Both count vectors have world_size
// entries, in group rank order, >= 0; offsets are implicit, the prefix sums of the counts:
// rank i sends its input rows [sum(send_counts[0..j)), ... + send_counts[j]) to rank j,
// and rank j receives them into its output rows [sum(recv_counts[0..i)), ... +
// recv_counts[i]). Rows past sum(send_counts) of `input` are not sent, and rows past
// sum(recv_counts) of `output` are left as they were, so buffers sized for the worst case
// work. What every rank must pass:
//  - rank i's send_counts[j] equals rank j's recv_counts[i] (each rank learns its
//    receive counts beforehand, in MoE from an all_to_all of the per-rank counts). The CPU
//    group checks it (rank 0 sees every rank's counts, and a mismatch fails every rank,
//    naming the pairs); the NCCL group does not (it would cost another exchange per
//    call): there a mismatch is NCCL's undefined behaviour (a receive waiting for bytes
//    that never come is ended by the watchdog's timeout; other mismatches may go
//    unnoticed), so get it right, and test new callers on the CPU group.
//  - the same dtype and row width on every rank (the CPU group checks that too).
// Zero counts are allowed anywhere (nothing is sent or received for that pair, and a call
// whose counts are all zero is valid), as is a rank sending every row to one rank, and a
// rank sending to itself (send_counts[rank()] == recv_counts[rank()]: a local copy, made
// by NCCL's send/recv to self, or by rank 0 on the CPU). Rows are moved as bytes, never
// converted, so any dtype works (MoE sends bf16 token rows and int32 indices; NCCL sends
// ncclUint8, as its dtype mapping covers only f32 and bf16). `input` and `output` must
// not overlap. The one-rank group copies (counts [n] and [n]).
//
// NOTE [Point-to-point]
// send_recv(ops) moves whole tensors between chosen pairs of ranks, as pipeline
// parallelism hands activations to the next stage and gradients back to the previous one.
// Each op is a send of its tensor to `peer` or a receive from `peer` into its tensor
// (peers are ranks of this group). The ops of one call run together, as one NCCL group
// (torch.distributed.batch_isend_irecv), so a rank may send to and receive from the same
// peer, or both neighbours, in one call without deadlock. What every rank must do:
//  - make the same number of send_recv calls on the group, together: on the CPU each
//    call is a round of the whole world like every other collective, and an empty `ops`
//    is a valid call, the way a rank with nothing to move this time takes part.
//  - pair them up: the k-th calls of the ranks belong together, and the sends from rank a
//    to rank b in a's call are matched, in the order a lists them, by the receives from a
//    in b's call, in the order b lists them, each pair of the same byte count. The two
//    tensors of a pair may differ in dtype and shape: bytes are moved, never converted
//    (any dtype; NCCL sends ncclUint8). A rank may send to itself (a local copy) only if
//    it also lists the matching receive from itself.
// The CPU group checks the pairing (rank 0 sees every rank's ops; a mismatch fails every
// rank, naming the ranks and op indices), as does every group for a rank's sends to itself;
// NCCL does not check across ranks (it would cost another exchange per call): there a
// mismatch is NCCL's undefined behaviour, as for all_to_all (NOTE [All-to-all]), so test
// new callers on the CPU group. Every rank checks its own ops before anything moves
// (check_send_recv): peers within the group, tensors defined and on the group's device
// (contiguous, as every forge Tensor is), and no receive tensor overlapping another op's
// tensor. Zero-byte ops are valid and move nothing; on NCCL a call with nothing to move
// enqueues nothing. The one-rank group copies its sends to itself into its receives.
//
// NOTE [NCCL watchdog]
// A rank whose peer died must not hang in a collective forever. The NCCL communicator is
// non-blocking (ncclConfig_t::blocking = 0) and a watchdog thread checks, every few
// milliseconds, NCCL's asynchronous error state and the completion events of the
// collectives in flight. When NCCL reports an error, or a collective has not completed
// `collective_timeout` after it was enqueued, the watchdog aborts the communicator
// (ncclCommAbort, which also ends the kernels still waiting on peers) and calls
// `on_failure` with a message naming this rank, the collective and the cause. The default
// on_failure prints the message and ends the process with exit code 1: a rank in that
// state cannot continue, and its exit is what lets `forge launch` (or srun, or mpirun)
// stop the others at once. Host-side waits (barrier, destroy) throw the same message
// instead of blocking.
// Two waits happen on the calling thread instead: a call that NCCL keeps "in progress"
// (the first collective of each algorithm connects to the peers, so it cannot finish
// until they call it too) fails the same way after `collective_timeout`, from that
// thread; and teardown is bounded because NCCL's own is not: ncclCommAbort and
// ncclCommDestroy wait until every peer rank has ended its communicator as well, so both
// run on a helper thread that is waited for a bounded time (abort 10 s, destroy
// `collective_timeout`) and then left behind. No wait of a rank on its peers is unbounded.
// Every collective enqueued goes into the flight record (flight_recorder.h), printed with
// the failure. With options.heartbeat_timeout (NOTE [Failure detection] in heartbeat.h)
// on_failure goes through the heartbeat, so rank 0 tells every rank, and a verdict that
// arrives from another rank first aborts every communicator of this process.

#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "distributed/launch_env.h"

#include "core/device.h"

namespace forge {

// Max: the elementwise maximum (FP8 amaxes, NOTE [FP8 under data parallelism] in
// train/trainer_fp8.cpp); which of a NaN and a number wins is the backend's (NCCL's is not
// documented), so callers reduce only finite values or do not read a NaN's result.
enum class ReduceOp { Sum, Avg, Max };
const char* reduce_op_name(ReduceOp op);  // "sum", "avg", "max"

struct ProcessGroupOptions {
  Device device = Device::CPU;
  // How long ranks wait for each other at the TCP rendezvous.
  std::chrono::milliseconds rendezvous_timeout = std::chrono::minutes(5);
  // How long a collective may run before the watchdog gives up on it (NOTE [NCCL watchdog]);
  // on the CPU, how long a rank waits for the others in a collective.
  std::chrono::milliseconds collective_timeout = std::chrono::minutes(10);
  // Above zero: the ranks watch each other through a heartbeat (NOTE [Failure detection]
  // in heartbeat.h), a rank silent this long has failed, and a failed collective ends the
  // process (after printing its flight record) instead of calling on_failure. Zero: off.
  std::chrono::milliseconds heartbeat_timeout{0};
  // NCCL: called once, after the communicator was aborted (from the watchdog thread, or
  // from the thread whose NCCL call never left "in progress"), or when destroy() timed
  // out. Empty: log the message and exit(1). CPU: called once, with the message the
  // failed collective then throws (there is nothing asynchronous to abort); empty: only
  // the throw. Groups split from a group inherit its options.
  std::function<void(const std::string& message)> on_failure;
};

// One send or receive of send_recv (NOTE [Point-to-point]).
struct PointToPoint {
  enum class Kind { Send, Recv };
  Kind kind;
  int peer;       // rank in this group
  Tensor tensor;  // sent from / received into, on the group's device; any dtype (moved as bytes)

  static PointToPoint send(int peer, Tensor tensor) { return {Kind::Send, peer, std::move(tensor)}; }
  static PointToPoint recv(int peer, Tensor tensor) { return {Kind::Recv, peer, std::move(tensor)}; }
};

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;

  // In place: `tensor` becomes the elementwise sum (mean, maximum) of every rank's `tensor`.
  virtual void all_reduce(const Tensor& tensor, ReduceOp op, CudaStream stream = nullptr) = 0;
  // `input` is world_size equal chunks; `output` (one chunk) becomes the sum (or mean)
  // over ranks of chunk `rank()`.
  virtual void reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op, CudaStream stream = nullptr) = 0;
  // `output` (world_size chunks) becomes every rank's `input`, in rank order.
  virtual void all_gather(const Tensor& output, const Tensor& input, CudaStream stream = nullptr) = 0;
  // Rows (along dim 0) with variable counts: this rank's input rows [sum(send_counts[0..r)),
  // ... + send_counts[r]) go to rank r, and rank r's rows for this rank arrive in output
  // rows [sum(recv_counts[0..r)), ... + recv_counts[r]). Every rank's send_counts[j] must
  // equal rank j's recv_counts[this rank]. See NOTE [All-to-all].
  virtual void all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                          const std::vector<int64_t>& send_counts, CudaStream stream = nullptr) = 0;
  // The ops together: each send's tensor goes to its peer, each receive's tensor is filled
  // from its peer. Every rank of the group calls it together (an empty `ops` included),
  // and the sends from a to b pair up in order with the receives from a at b, of equal
  // byte counts. See NOTE [Point-to-point].
  virtual void send_recv(const std::vector<PointToPoint>& ops, CudaStream stream = nullptr) = 0;
  // Returns when every rank has called barrier() and the collectives this rank enqueued
  // before it have completed.
  virtual void barrier() = 0;
  // Waits for the collectives in flight and releases the communicator; later calls are
  // errors. The destructor does this too (and never throws).
  virtual void destroy() = 0;
  // Every rank of this group calls it together: returns the group of the ranks that
  // passed the same `color` (>= 0), ranked by (`key`, rank in this group). See NOTE
  // [Process group].
  virtual std::unique_ptr<ProcessGroup> split(int color, int key) = 0;
};

std::unique_ptr<ProcessGroup> create_process_group(const LaunchEnv& env, const ProcessGroupOptions& options);

// Argument checks shared by the implementations; each throws naming the collective.
void check_all_reduce(const Tensor& tensor, Device device);
void check_reduce_scatter(const Tensor& output, const Tensor& input, int world_size, Device device);
void check_all_gather(const Tensor& output, const Tensor& input, int world_size, Device device);
// all_to_all: world_size counts each, none negative, their sums within the tensors' rows,
// output and input of one dtype, row width and device, not overlapping.
void check_all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                      const std::vector<int64_t>& send_counts, int world_size, Device device);
// send_recv: every op's peer in [0, world_size), its tensor defined and on `device`, and
// no receive tensor overlapping another op's tensor. Errors name the op by its index.
void check_send_recv(const std::vector<PointToPoint>& ops, int world_size, Device device);
// The elements of one row of `t` (the product of its dims after the first).
int64_t row_elements(const Tensor& t);
void check_split(int color);

}  // namespace forge
