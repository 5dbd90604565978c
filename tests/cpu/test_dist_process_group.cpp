// The process group on the CPU: the single-rank group whose collectives are the identity
// (or a copy) and whose split is another single-rank group, argument checks shared with
// NCCL's group, and the clear refusals of what the CPU cannot do (several ranks; CUDA
// without the CUDA backend).
#include <gtest/gtest.h>

#include "config_test_support.h"
#include "dist/process_group.h"

namespace forge {
namespace {

using config_test::expect_error;

Tensor iota(int64_t n, float start) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = start + static_cast<float>(i);
  return t;
}

std::vector<float> values(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

TEST(ProcessGroupCpu, OneRankCollectivesAreTheIdentity) {
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  EXPECT_EQ(group->rank(), 0);
  EXPECT_EQ(group->world_size(), 1);
  Tensor t = iota(6, 1);
  group->all_reduce(t, ReduceOp::Sum);
  group->all_reduce(t, ReduceOp::Avg);
  EXPECT_EQ(values(t), values(iota(6, 1)));

  Tensor out = Tensor::zeros({2, 3});
  group->reduce_scatter(out, t, ReduceOp::Sum);
  EXPECT_EQ(values(out), values(t));
  Tensor gathered = Tensor::zeros({6});
  group->all_gather(gathered, iota(6, 10));
  EXPECT_EQ(values(gathered), values(iota(6, 10)));
  group->barrier();
  group->destroy();
  EXPECT_THROW(group->barrier(), Error);
}

TEST(ProcessGroupCpu, OneRankSplitsIntoAnotherOneRankGroup) {
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  auto sub = group->split(3, -7);
  EXPECT_EQ(sub->rank(), 0);
  EXPECT_EQ(sub->world_size(), 1);
  auto subsub = sub->split(0, 0);
  EXPECT_EQ(subsub->world_size(), 1);
  group->destroy();  // the split group lives on
  Tensor t = iota(4, 2);
  sub->all_reduce(t, ReduceOp::Avg);
  EXPECT_EQ(values(t), values(iota(4, 2)));
  Tensor gathered = Tensor::zeros({4});
  sub->all_gather(gathered, t);
  EXPECT_EQ(values(gathered), values(t));
  sub->barrier();
  expect_error([&] { sub->split(-1, 0); }, {"split: color -1 is negative"});
  expect_error([&] { group->split(0, 0); }, {"process group used after destroy()"});
  sub->destroy();
  EXPECT_THROW(sub->barrier(), Error);
  subsub->barrier();
}

TEST(ProcessGroupCpu, ArgumentsAreChecked) {
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  Tensor f32 = Tensor::zeros({4});
  expect_error([&] { group->all_reduce(Tensor::zeros({4}, DType::I32), ReduceOp::Sum); },
               {"all_reduce: tensor is i32, expected f32 or bf16"});
  expect_error([&] { group->reduce_scatter(f32, Tensor::zeros({5}), ReduceOp::Sum); },
               {"reduce_scatter: input [5] must hold world size 1 chunks of output [4]"});
  expect_error([&] { group->all_gather(Tensor::zeros({4}, DType::BF16), f32); },
               {"all_gather: output is bf16, input f32"});
  expect_error([] { check_all_gather(Tensor::zeros({6}), Tensor::zeros({4}), 2, Device::CPU); },
               {"all_gather: output [6] must hold world size 2 chunks of input [4]"});
  expect_error([] { check_all_reduce(Tensor::zeros({4}), Device::CUDA); },
               {"all_reduce: tensor is on cpu, the process group on cuda"});
}

TEST(ProcessGroupCpu, SeveralRanksNeedGpus) {
  LaunchEnv env;
  env.rank = 1;
  env.world_size = 2;
  env.local_world_size = 2;
  env.local_rank = 1;
  env.master_addr = "localhost";
  env.master_port = 29500;
  env.launcher = Launcher::Torchrun;
  expect_error([&] { create_process_group(env, ProcessGroupOptions{}); },
               {"rank 1 of 2", "ranks communicate through NCCL"});
#ifndef FORGE_CUDA
  ProcessGroupOptions cuda;
  cuda.device = Device::CUDA;
  expect_error([&] { create_process_group(env, cuda); }, {"rank 1 of 2", "-DFORGE_CUDA=ON"});
#endif
}

}  // namespace
}  // namespace forge
