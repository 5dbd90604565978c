// Where this process sits in a distributed job, read from the environment the way
// clusters start jobs: torchrun (and `forge launch`, which sets the same variables),
// Slurm's srun, or Open MPI's mpirun. With none of them, forge is a single process.
//
// NOTE [Launcher precedence]
// The first launcher whose marker variable is set wins, in this order:
//   1. torchrun:  RANK or WORLD_SIZE set. Needs RANK, WORLD_SIZE, LOCAL_RANK,
//      LOCAL_WORLD_SIZE; GROUP_RANK (the node) is optional.
//   2. Slurm:     SLURM_PROCID set. SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
//      SLURM_NODEID, and the tasks on this node from SLURM_NTASKS_PER_NODE or else
//      SLURM_TASKS_PER_NODE ("4(x2),3"); the master is MASTER_ADDR or else the first host
//      of SLURM_JOB_NODELIST (or SLURM_NODELIST), the port MASTER_PORT or else one derived
//      from SLURM_JOB_ID, so every task of a job agrees without being told.
//   3. Open MPI:  OMPI_COMM_WORLD_RANK set. OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE;
//      MPI knows no master address, so MASTER_ADDR and MASTER_PORT must be exported.
// torchrun comes first because it is the innermost launcher whenever they nest: `forge
// launch` or torchrun started by srun or mpirun sees the outer launcher's variables too,
// and its children must follow the variables it set for them.
// A value that is not a number, out of range, or inconsistent with another (RANK >=
// WORLD_SIZE) is an error naming the variable; so is a missing master address or port
// when the world has more than one rank.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace forge {

enum class Launcher { Single, Torchrun, Slurm, OpenMpi };

std::string_view launcher_name(Launcher launcher);

struct LaunchEnv {
  int rank = 0;  // global rank, 0 .. world_size - 1
  int world_size = 1;
  int local_rank = 0;        // rank on this node: the GPU this process drives
  int local_world_size = 1;  // ranks on this node
  int node_rank = 0;
  std::string master_addr;  // where rank 0 listens for the rendezvous (empty for a single process)
  int master_port = 0;
  Launcher launcher = Launcher::Single;
};

// The value of an environment variable, or nullopt when it is unset.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// Reads the launch environment through `env` (tests pass a map); see NOTE [Launcher precedence].
LaunchEnv read_launch_env(const EnvLookup& env);
// The same from this process's environment.
LaunchEnv read_launch_env();

// "rank 3 of 8 (local 1 of 4, node 1) via slurm, master gpu01:29500"
std::string describe(const LaunchEnv& env);

}  // namespace forge
