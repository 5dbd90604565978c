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
// Each rank runs in its own process group, and signals go to the whole group, so a rank
// that is a shell script takes the programs it started down with it. If the launcher
// itself is killed outright, the kernel sends each rank SIGTERM (PR_SET_PDEATHSIG).
// Output: each line a rank writes to stdout or stderr is passed to the launcher's stdout
// or stderr prefixed "[rank R] " (rank_output.h). Ranks read stdin from /dev/null.
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
  std::vector<std::string> command;
};

// Runs the ranks to the end and returns the launcher's exit code (NOTE [Launcher failure
// handling]). `forge_subcommands` are the names that mean "run this forge binary".
// Bad options throw forge::Error.
int run_launch(const LaunchOptions& options, const std::vector<std::string>& forge_subcommands);

}  // namespace forge
