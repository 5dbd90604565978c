// The launch environment: torchrun, Slurm and Open MPI variables as those launchers set
// them, their precedence, and malformed or inconsistent values named in the error.
#include <gtest/gtest.h>

#include <map>

#include "config_test_support.h"
#include "distributed/launch_env.h"
#include "distributed/slurm_lists.h"

namespace forge {
namespace {

using config_test::expect_error;
using Vars = std::map<std::string, std::string>;

LaunchEnv read(const Vars& vars) {
  return read_launch_env([&](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

Vars torchrun_vars() {
  return {{"RANK", "5"},
          {"WORLD_SIZE", "8"},
          {"LOCAL_RANK", "1"},
          {"LOCAL_WORLD_SIZE", "4"},
          {"MASTER_ADDR", "node0"},
          {"MASTER_PORT", "29500"}};
}

Vars slurm_vars() {
  return {{"SLURM_PROCID", "6"},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", "2"},
          {"SLURM_NODEID", "1"},
          {"SLURM_TASKS_PER_NODE", "4(x2)"},
          {"SLURM_JOB_NODELIST", "gpu[01-04,07],login1"},
          {"SLURM_JOB_ID", "123456"}};
}

Vars mpi_vars() {
  return {{"OMPI_COMM_WORLD_RANK", "3"},       {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"MASTER_ADDR", "10.0.0.1"},   {"MASTER_PORT", "6000"}};
}

Vars with(Vars vars, const Vars& changes) {
  for (const auto& [k, v] : changes) vars[k] = v;
  return vars;
}
Vars without(Vars vars, const std::string& name) {
  vars.erase(name);
  return vars;
}

TEST(LaunchEnv, NoLauncherIsASingleProcess) {
  const LaunchEnv e = read({{"HOME", "/root"}});
  EXPECT_EQ(e.launcher, Launcher::Single);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_EQ(e.local_rank, 0);
  EXPECT_EQ(e.local_world_size, 1);
  EXPECT_EQ(e.node_rank, 0);
}

TEST(LaunchEnv, Torchrun) {
  const LaunchEnv e = read(torchrun_vars());
  EXPECT_EQ(e.launcher, Launcher::Torchrun);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);  // rank / local world size without GROUP_RANK
  EXPECT_EQ(e.master_addr, "node0");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_EQ(read(with(torchrun_vars(), {{"GROUP_RANK", "3"}})).node_rank, 3);
  EXPECT_EQ(describe(e), "rank 5 of 8 (local 1 of 4, node 1) via torchrun, master node0:29500");
}

TEST(LaunchEnv, TorchrunSingleRankNeedsNoMaster) {
  const LaunchEnv e = read({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "1"}});
  EXPECT_EQ(e.launcher, Launcher::Torchrun);
  EXPECT_EQ(e.world_size, 1);
  EXPECT_TRUE(e.master_addr.empty());
}

TEST(LaunchEnv, Slurm) {
  const LaunchEnv e = read(slurm_vars());
  EXPECT_EQ(e.launcher, Launcher::Slurm);
  EXPECT_EQ(e.rank, 6);
  EXPECT_EQ(e.world_size, 8);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(e.local_world_size, 4);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "gpu01");
  EXPECT_EQ(e.master_port, 10000 + 123456 % 20000);
}

TEST(LaunchEnv, SlurmTasksPerNodeOfThisNode) {
  // Three nodes with 4, 4 and 3 tasks; this is the third.
  const LaunchEnv e = read(with(slurm_vars(), {{"SLURM_NTASKS", "11"},
                                               {"SLURM_PROCID", "9"},
                                               {"SLURM_LOCALID", "1"},
                                               {"SLURM_NODEID", "2"},
                                               {"SLURM_TASKS_PER_NODE", "4(x2),3"}}));
  EXPECT_EQ(e.local_world_size, 3);
  // SLURM_NTASKS_PER_NODE, when given, is used as is.
  EXPECT_EQ(
      read(with(slurm_vars(), {{"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_TASKS_PER_NODE", "junk"}})).local_world_size, 4);
}

TEST(LaunchEnv, SlurmMasterFromEnvironmentOrStepOrLegacyNodelist) {
  EXPECT_EQ(read(with(slurm_vars(), {{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "4242"}})).master_addr, "10.1.2.3");
  EXPECT_EQ(read(with(slurm_vars(), {{"MASTER_PORT", "4242"}})).master_port, 4242);
  EXPECT_EQ(read(with(slurm_vars(), {{"SLURM_STEP_NODELIST", "gpu[03-04]"}})).master_addr, "gpu03");
  EXPECT_EQ(read(with(without(slurm_vars(), "SLURM_JOB_NODELIST"), {{"SLURM_NODELIST", "a1,b2"}})).master_addr, "a1");
}

TEST(LaunchEnv, OpenMpi) {
  const LaunchEnv e = read(mpi_vars());
  EXPECT_EQ(e.launcher, Launcher::OpenMpi);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world_size, 4);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.local_world_size, 2);
  EXPECT_EQ(e.node_rank, 1);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 6000);
}

TEST(LaunchEnv, TorchrunVariablesComeFirst) {
  Vars all = slurm_vars();
  for (const auto& [k, v] : mpi_vars()) all[k] = v;
  EXPECT_EQ(read(all).launcher, Launcher::Slurm);
  for (const auto& [k, v] : torchrun_vars()) all[k] = v;
  const LaunchEnv e = read(all);
  EXPECT_EQ(e.launcher, Launcher::Torchrun);
  EXPECT_EQ(e.rank, 5);
}

TEST(LaunchEnv, RankMustBeBelowWorldSize) {
  expect_error([] { read(with(torchrun_vars(), {{"RANK", "8"}})); }, {"RANK=8 must be less than WORLD_SIZE=8"});
  expect_error(
      [] {
        read(with(torchrun_vars(), {{"LOCAL_RANK", "4"}}));
      },
      {"LOCAL_RANK=4 must be less than LOCAL_WORLD_SIZE=4"});
  expect_error(
      [] {
        read(with(torchrun_vars(), {{"LOCAL_WORLD_SIZE", "16"}}));
      },
      {"LOCAL_WORLD_SIZE=16 must not exceed WORLD_SIZE=8"});
  expect_error(
      [] {
        read(with(slurm_vars(), {{"SLURM_PROCID", "9"}}));
      },
      {"SLURM_PROCID=9 must be less than SLURM_NTASKS=8"});
  expect_error(
      [] {
        read(with(mpi_vars(), {{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}}));
      },
      {"OMPI_COMM_WORLD_LOCAL_RANK=2 must be less than OMPI_COMM_WORLD_LOCAL_SIZE=2"});
}

TEST(LaunchEnv, NonNumericValuesAreNamed) {
  expect_error([] { read(with(torchrun_vars(), {{"WORLD_SIZE", "eight"}})); }, {"WORLD_SIZE='eight'", "integer"});
  expect_error([] { read(with(torchrun_vars(), {{"RANK", "3x"}})); }, {"RANK='3x'"});
  expect_error([] { read(with(torchrun_vars(), {{"RANK", ""}})); }, {"RANK=''"});
  expect_error([] { read(with(torchrun_vars(), {{"RANK", "-1"}})); }, {"RANK=-1", ">= 0"});
  expect_error([] { read(with(torchrun_vars(), {{"WORLD_SIZE", "0"}})); }, {"WORLD_SIZE=0", ">= 1"});
  expect_error([] { read(with(torchrun_vars(), {{"MASTER_PORT", "70000"}})); }, {"MASTER_PORT=70000", "65535"});
  expect_error([] { read(with(torchrun_vars(), {{"MASTER_PORT", "http"}})); }, {"MASTER_PORT='http'"});
  expect_error([] { read(with(slurm_vars(), {{"SLURM_LOCALID", "one"}})); }, {"SLURM_LOCALID='one'"});
  expect_error([] { read(with(slurm_vars(), {{"SLURM_TASKS_PER_NODE", "4(2)"}})); }, {"SLURM_TASKS_PER_NODE='4(2)'"});
  expect_error([] { read(with(slurm_vars(), {{"SLURM_JOB_NODELIST", "gpu[01-"}})); }, {"SLURM_JOB_NODELIST='gpu[01-'"});
  expect_error([] { read(with(mpi_vars(), {{"OMPI_COMM_WORLD_SIZE", "4.0"}})); }, {"OMPI_COMM_WORLD_SIZE='4.0'"});
}

TEST(LaunchEnv, MissingVariablesAreNamed) {
  expect_error([] { read(without(torchrun_vars(), "MASTER_ADDR")); }, {"MASTER_ADDR is not set", "8 ranks"});
  expect_error([] { read(without(torchrun_vars(), "MASTER_PORT")); }, {"MASTER_PORT is not set"});
  expect_error([] { read(without(torchrun_vars(), "LOCAL_WORLD_SIZE")); }, {"LOCAL_WORLD_SIZE is not set"});
  expect_error([] { read(without(torchrun_vars(), "RANK")); }, {"RANK is not set"});
  expect_error([] { read(without(mpi_vars(), "MASTER_ADDR")); }, {"MASTER_ADDR is not set", "mpirun gives no address"});
  expect_error([] { read(without(slurm_vars(), "SLURM_NTASKS")); }, {"SLURM_NTASKS is not set"});
  expect_error([] { read(without(slurm_vars(), "SLURM_TASKS_PER_NODE")); }, {"SLURM_TASKS_PER_NODE is not set"});
  expect_error([] { read(without(slurm_vars(), "SLURM_JOB_NODELIST")); }, {"MASTER_ADDR", "SLURM_JOB_NODELIST"});
  expect_error([] { read(without(slurm_vars(), "SLURM_JOB_ID")); }, {"MASTER_PORT", "SLURM_JOB_ID"});
  expect_error(
      [] {
        read(with(slurm_vars(), {{"SLURM_NODEID", "2"}}));
      },
      {"SLURM_NODEID=2", "SLURM_TASKS_PER_NODE='4(x2)' lists 2 node(s)"});
}

TEST(SlurmLists, Hostlists) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expand_hostlist("gpu[01-04,07],login1", "X"), (V{"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login1"}));
  EXPECT_EQ(expand_hostlist("node7", "X"), (V{"node7"}));
  EXPECT_EQ(expand_hostlist("n[8-10]", "X"), (V{"n8", "n9", "n10"}));
  EXPECT_EQ(expand_hostlist("n[098-100].ib", "X"), (V{"n098.ib", "n099.ib", "n100.ib"}));
  EXPECT_EQ(expand_hostlist("r[1-2]-n[1,3]", "X"), (V{"r1-n1", "r1-n3", "r2-n1", "r2-n3"}));
  EXPECT_EQ(expand_hostlist("a,b[2],c", "X"), (V{"a", "b2", "c"}));
  for (const char* bad : {"gpu[01-04", "gpu01]", "gpu[[1]]", "gpu[]", "gpu[4-1]", "gpu[a-b]", "a,,b", ",a", ""})
    expect_error([&] { expand_hostlist(bad, "SLURM_JOB_NODELIST"); }, {"SLURM_JOB_NODELIST"});
  expect_error([] { expand_hostlist("n[0-99999999]", "X"); }, {"more than"});
}

TEST(SlurmLists, TasksPerNode) {
  using V = std::vector<int>;
  EXPECT_EQ(expand_tasks_per_node("4(x2),3", "X"), (V{4, 4, 3}));
  EXPECT_EQ(expand_tasks_per_node("8", "X"), (V{8}));
  EXPECT_EQ(expand_tasks_per_node("1,2(x1)", "X"), (V{1, 2}));
  for (const char* bad : {"4(x2", "4(2)", "x", "4(x)", "", "4,", "-1"})
    expect_error([&] { expand_tasks_per_node(bad, "SLURM_TASKS_PER_NODE"); }, {"SLURM_TASKS_PER_NODE"});
}

}  // namespace
}  // namespace forge
