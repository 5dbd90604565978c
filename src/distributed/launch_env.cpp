#include "distributed/launch_env.h"

#include <fmt/format.h>

#include <charconv>
#include <cstdlib>

#include "core/error.h"
#include "distributed/slurm_lists.h"

namespace forge {
namespace {

// Ports derived from SLURM_JOB_ID fall in [10000, 30000): above the well-known and
// registered services most clusters run, below Linux's ephemeral range (32768+), so a
// derived port never collides with an outgoing connection's local port.
constexpr int kSlurmPortBase = 10000;
constexpr int kSlurmPortSpan = 20000;

class Reader {
 public:
  Reader(const EnvLookup& env, std::string_view launcher_hint) : env_(env), hint_(launcher_hint) {}

  std::optional<std::string> get(const char* name) const { return env_(name); }

  std::string required(const char* name) const {
    std::optional<std::string> value = env_(name);
    if (!value) FORGE_FAIL("{} is not set ({})", name, hint_);
    return *value;
  }

  int integer(const char* name, const std::string& value, int min) const {
    int parsed = 0;
    auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), parsed);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size())
      FORGE_FAIL("{}='{}': expected an integer", name, value);
    if (parsed < min) FORGE_FAIL("{}={}: expected an integer >= {}", name, parsed, min);
    return parsed;
  }
  int required_int(const char* name, int min) const { return integer(name, required(name), min); }
  std::optional<int> optional_int(const char* name, int min) const {
    std::optional<std::string> value = env_(name);
    if (!value) return std::nullopt;
    return integer(name, *value, min);
  }

 private:
  const EnvLookup& env_;
  std::string_view hint_;
};

int port_value(const Reader& r, const char* name, const std::string& value) {
  const int port = r.integer(name, value, 1);
  if (port > 65535) FORGE_FAIL("{}={}: expected a TCP port, 1 to 65535", name, port);
  return port;
}

// MASTER_ADDR / MASTER_PORT from the environment; required when there are peers to meet.
void read_master(const Reader& r, LaunchEnv& e, std::string_view why) {
  if (std::optional<std::string> addr = r.get("MASTER_ADDR")) {
    if (addr->empty()) FORGE_FAIL("MASTER_ADDR is set but empty: expected the host name or address of rank 0");
    e.master_addr = *addr;
  } else if (e.world_size > 1) {
    FORGE_FAIL("MASTER_ADDR is not set: {} ranks need the address of rank 0 ({})", e.world_size, why);
  }
  if (std::optional<std::string> port = r.get("MASTER_PORT")) {
    e.master_port = port_value(r, "MASTER_PORT", *port);
  } else if (e.world_size > 1) {
    FORGE_FAIL("MASTER_PORT is not set: {} ranks need the port rank 0 listens on ({})", e.world_size, why);
  }
}

void check_consistent(const LaunchEnv& e, const char* rank, const char* world, const char* local_rank,
                      const char* local_world) {
  if (e.rank >= e.world_size) FORGE_FAIL("{}={} must be less than {}={}", rank, e.rank, world, e.world_size);
  if (e.local_rank >= e.local_world_size)
    FORGE_FAIL("{}={} must be less than {}={}", local_rank, e.local_rank, local_world, e.local_world_size);
  if (e.local_world_size > e.world_size)
    FORGE_FAIL("{}={} must not exceed {}={}", local_world, e.local_world_size, world, e.world_size);
}

LaunchEnv read_torchrun(const Reader& r) {
  LaunchEnv e;
  e.launcher = Launcher::Torchrun;
  e.rank = r.required_int("RANK", 0);
  e.world_size = r.required_int("WORLD_SIZE", 1);
  e.local_rank = r.required_int("LOCAL_RANK", 0);
  e.local_world_size = r.required_int("LOCAL_WORLD_SIZE", 1);
  check_consistent(e, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  e.node_rank = r.optional_int("GROUP_RANK", 0).value_or(e.rank / e.local_world_size);
  read_master(r, e, "torchrun and forge launch set it");
  return e;
}

LaunchEnv read_slurm(const Reader& r) {
  LaunchEnv e;
  e.launcher = Launcher::Slurm;
  e.rank = r.required_int("SLURM_PROCID", 0);
  e.world_size = r.required_int("SLURM_NTASKS", 1);
  e.local_rank = r.required_int("SLURM_LOCALID", 0);
  e.node_rank = r.required_int("SLURM_NODEID", 0);
  if (std::optional<int> per_node = r.optional_int("SLURM_NTASKS_PER_NODE", 1)) {
    e.local_world_size = *per_node;
  } else {
    const std::string list = r.required("SLURM_TASKS_PER_NODE");
    const std::vector<int> counts = expand_tasks_per_node(list, "SLURM_TASKS_PER_NODE");
    if (static_cast<size_t>(e.node_rank) >= counts.size())
      FORGE_FAIL("SLURM_NODEID={} but SLURM_TASKS_PER_NODE='{}' lists {} node(s)", e.node_rank, list, counts.size());
    e.local_world_size = counts[e.node_rank];
  }
  check_consistent(
      e, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
      r.get("SLURM_NTASKS_PER_NODE") ? "SLURM_NTASKS_PER_NODE" : "SLURM_TASKS_PER_NODE (this node's count)");

  if (std::optional<std::string> addr = r.get("MASTER_ADDR")) {
    if (addr->empty()) FORGE_FAIL("MASTER_ADDR is set but empty: expected the host name or address of rank 0");
    e.master_addr = *addr;
  } else {
    for (const char* name : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"}) {
      if (std::optional<std::string> list = r.get(name)) {
        e.master_addr = expand_hostlist(*list, name).front();
        break;
      }
    }
    if (e.master_addr.empty() && e.world_size > 1)
      FORGE_FAIL("neither MASTER_ADDR nor SLURM_JOB_NODELIST is set: {} Slurm tasks need the host of task 0",
                 e.world_size);
  }
  if (std::optional<std::string> port = r.get("MASTER_PORT")) {
    e.master_port = port_value(r, "MASTER_PORT", *port);
  } else if (std::optional<int> job = r.optional_int("SLURM_JOB_ID", 0)) {
    e.master_port = kSlurmPortBase + *job % kSlurmPortSpan;
  } else if (e.world_size > 1) {
    FORGE_FAIL("neither MASTER_PORT nor SLURM_JOB_ID is set: {} Slurm tasks need a port to meet on", e.world_size);
  }
  return e;
}

LaunchEnv read_open_mpi(const Reader& r) {
  LaunchEnv e;
  e.launcher = Launcher::OpenMpi;
  e.rank = r.required_int("OMPI_COMM_WORLD_RANK", 0);
  e.world_size = r.required_int("OMPI_COMM_WORLD_SIZE", 1);
  e.local_rank = r.required_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
  e.local_world_size = r.required_int("OMPI_COMM_WORLD_LOCAL_SIZE", 1);
  check_consistent(e, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                   "OMPI_COMM_WORLD_LOCAL_SIZE");
  // mpirun exports no node index; with its default by-slot mapping nodes hold
  // consecutive blocks of ranks.
  e.node_rank = e.rank / e.local_world_size;
  read_master(r, e, "mpirun gives no address: pass -x MASTER_ADDR=<host of rank 0> -x MASTER_PORT=<port>");
  return e;
}

}  // namespace

std::string_view launcher_name(Launcher launcher) {
  switch (launcher) {
    case Launcher::Single:
      return "single process";
    case Launcher::Torchrun:
      return "torchrun";
    case Launcher::Slurm:
      return "slurm";
    case Launcher::OpenMpi:
      return "open mpi";
  }
  return "?";
}

LaunchEnv read_launch_env(const EnvLookup& env) {
  if (env("RANK") || env("WORLD_SIZE"))
    return read_torchrun(Reader(env, "torchrun and forge launch set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE"));
  if (env("SLURM_PROCID"))
    return read_slurm(Reader(env, "srun sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID"));
  if (env("OMPI_COMM_WORLD_RANK"))
    return read_open_mpi(Reader(env, "mpirun sets OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE"));
  return LaunchEnv{};
}

LaunchEnv read_launch_env() {
  return read_launch_env([](const char* name) -> std::optional<std::string> {
    const char* value = std::getenv(name);
    if (!value) return std::nullopt;
    return std::string(value);
  });
}

std::string describe(const LaunchEnv& e) {
  if (e.launcher == Launcher::Single) return "single process (rank 0 of 1)";
  return fmt::format("rank {} of {} (local {} of {}, node {}) via {}, master {}:{}", e.rank, e.world_size, e.local_rank,
                     e.local_world_size, e.node_rank, launcher_name(e.launcher), e.master_addr, e.master_port);
}

}  // namespace forge
