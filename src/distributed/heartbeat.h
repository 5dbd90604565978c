// Failure detection across the ranks of a job: a heartbeat between every rank and rank 0.
//
// NOTE [Failure detection]
// A collective only notices a dead peer when it needs it, and on NCCL only after
// parallelism.nccl_timeout_s; a rank computing, reading data or saving notices nothing.
// So after the TCP rendezvous every rank opens a second connection to rank 0 (rank 0
// listens on a port of its choosing, handed out by TcpStore::broadcast), and a thread on
// each rank sends a beat carrying the step it is in (report_step) every
// heartbeat_timeout / 10 (at most 1 s) and reads what comes back:
//  - rank 0 notices a peer whose connection closes without a goodbye (its process exited,
//    crashed or was killed: at once) or that is silent for heartbeat_timeout (stopped,
//    or its host unreachable), and sends every rank the verdict, naming that rank and the
//    step it was in;
//  - a peer notices rank 0 vanishing or falling silent the same way;
//  - a rank whose collective fails (NOTE [CPU process group], NOTE [NCCL watchdog]) tells
//    rank 0, which tells every rank; a rank stuck outside any collective (alive, beating,
//    but not arriving) is named by the others' collective timeout, and the verdict then
//    reaches it through its heartbeat thread too.
// A rank that learns of a failure prints the verdict with its flight record (the last
// collectives: flight_recorder.h), runs `before_exit` (NCCL: abort the communicators)
// and exits: 1 when it is the rank at fault or the fault is not one rank's,
// kExitPeerFailed (core/exit_status.h) when another rank is named. A rank leaving on
// purpose (its Heartbeat destroyed other than by an exception) says goodbye first; one
// whose Heartbeat is destroyed by an exception says it is exiting on an error (its own
// log then prints which), and the others stop naming it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "distributed/launch_env.h"

namespace forge {

class TcpStore;

struct HeartbeatOptions {
  std::chrono::milliseconds timeout{60000};             // silence that fails a rank
  std::chrono::milliseconds rendezvous_timeout{300000};  // for the connections to rank 0
  std::function<void()> before_exit;                     // e.g. abort NCCL communicators
};

class Heartbeat {
 public:
  // Every rank of `store` together, right after its rendezvous. World size 1: nothing.
  Heartbeat(TcpStore& store, const LaunchEnv& env, HeartbeatOptions options);
  // Says goodbye unless an exception is unwinding (then the others learn of the exit).
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // This rank cannot go on because of `reason`: rank 0 tells every rank (a peer waits
  // briefly for rank 0's verdict, and tells rank 0 when none comes), prints it with the
  // flight record, exits.
  // `at_fault`: the rank the reason blames, or -1.
  [[noreturn]] void fail(const std::string& reason, int at_fault = -1);

  struct State;

 private:
  std::shared_ptr<State> state_;
};

// The step this rank is in (from 1; 0: not training yet), carried by its heartbeats and
// named in failure messages. Process-wide.
void report_step(int64_t step);
int64_t reported_step();

// Test hook: FORGE_DEBUG_HANG_AT="RANK:STEP" makes rank RANK sleep forever when it starts
// step STEP, as a rank stuck outside any collective would, for tests of the collective
// timeout. Honoured only in a launcher's first attempt (FORGE_RESTART_COUNT unset or 0).
void debug_hang_if_requested(int rank, int64_t step);

}  // namespace forge
