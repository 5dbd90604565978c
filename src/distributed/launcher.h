// `forge launch`: starts this node's ranks of a job the way torchrun does, so that one
// command runs on a workstation and, once per node, on a cluster.
//
// Each local rank gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT) and FORGE_LAUNCHED=1, which
// read_launch_env() (launch_env.h) reads back. A COMMAND that names a forge subcommand
// (train, bench, ...) runs this very binary (/proc/self/exe); anything else is executed
// as given, searched in PATH, as torchrun runs a script.
//
// NOTE [Launcher failure handling]
// A job is only as alive as its least alive rank: once one rank fails, the others soon
// wait forever on a collective. So the launcher
//  - reports the first rank that exits non-zero or dies of a signal ("rank 2 exited with
//    code 1", "rank 3 was killed by signal 9 (SIGKILL)"), sends SIGTERM to every other
//    rank, SIGKILL to those still running after the grace period, and exits with that
//    rank's code (128 + signal for a signal);
//  - forwards SIGINT, SIGTERM and SIGHUP it receives to every rank, again escalating to
//    SIGKILL after the grace period (at once on a second signal), and exits 128 + signal;
//  - exits 0 only when every rank exited 0.
// A forge rank notices a failed peer itself (NOTE [Failure detection]) and exits naming
// it: when COMMAND is a forge subcommand the launcher gives the other ranks 5 s for that
// before the SIGTERM; a rank that exits kExitPeerFailed (core/exit_status.h) is never the
// one reported while a rank that failed on its own is known.
// Each rank runs in its own process group, and signals go to the whole group, so a rank
// that is a shell script takes the programs it started down with it. If the launcher
// itself is killed outright, the kernel sends each rank SIGTERM (PR_SET_PDEATHSIG).
// Output: each line a rank writes to stdout or stderr is passed to the launcher's stdout
// or stderr prefixed "[rank R] " (rank_output.h). Ranks read stdin from /dev/null.
//
// NOTE [Launcher restarts]
// --max-restarts N (torchrun's elastic restarts on a fixed world size): when the job
// failed (a rank exited non-zero or died of a signal), every rank of this node has
// ended and restarts are left, the launcher starts this node's ranks again, with the
// same command, on a new port on one node (the same --master-port on several), with
// FORGE_RESTART_COUNT (0 on the first attempt), FORGE_MAX_RESTARTS and
// FORGE_RESTART_REASON ("rank 2 was killed by signal 9 (SIGKILL)") set; `forge train`
// resumes from the newest checkpoint and records the restart in RUN_DIR/restarts.log.
// No restart after the launcher was signalled, or when the first failed rank exited
// kExitStoppedBySignal (a stop on request, core/exit_status.h). Several nodes agree on
// a restart without talking to each other: a failure anywhere ends every rank (the
// heartbeat), so every node's launcher sees a failure and restarts its ranks, which meet
// again at the rendezvous (within parallelism.rendezvous_timeout_s); each launcher counts
// its own restarts, so every node must be given the same --max-restarts, and a node
// that starts late or gives up makes the others' rendezvous fail and count a restart.
#pragma once

#include <string>
#include <vector>

namespace forge {

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;  // empty: 127.0.0.1 on one node; required with nnodes > 1
  int master_port = 0;      // 0: a free port on one node, 29500 with nnodes > 1
  double grace_period_s = 10;
  int max_restarts = 0;  // NOTE [Launcher restarts]
  std::vector<std::string> command;
};

// Runs the ranks to the end and returns the launcher's exit code (NOTE [Launcher failure
// handling]). `forge_subcommands` are the names that mean "run this forge binary".
// Bad options throw forge::Error.
int run_launch(const LaunchOptions& options, const std::vector<std::string>& forge_subcommands);

}  // namespace forge
