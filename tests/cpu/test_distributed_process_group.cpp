// The process group on the CPU: the single-rank group whose collectives are the identity
// (or a copy) and whose split is another single-rank group, argument checks shared with
// NCCL's group, CUDA refused without the CUDA backend, and the CPU group of several ranks
// with its ranks as threads of this process: the group create_process_group gives, its
// failures reported and lasting. Its values across real processes are checked by
// tests/python/test_cpu_process_group.py.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <limits>
#include <mutex>
#include <thread>

#include "config_test_support.h"
#include "rank_threads.h"
#include "core/bf16.h"
#include "distributed/process_group.h"
#include "distributed/tcp_socket.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using config_test::expect_error;
using testing::env_of;
using testing::free_port;
using testing::run_ranks;

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

TEST(ProcessGroupCpu, OneRankAllToAllCopiesItsRowsToItself) {
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  // f32 rows of 3: the first 4 of 5 rows go to itself; the output's last 2 rows stay.
  Tensor input = iota(15, 1).view({5, 3});
  Tensor output = Tensor::empty({6, 3});
  std::fill(output.data<float>(), output.data<float>() + 18, -1.0f);
  group->all_to_all(output, {4}, input, {4});
  std::vector<float> expected = values(iota(12, 1));
  expected.resize(18, -1.0f);
  EXPECT_EQ(values(output), expected);
  // int32 rows of one element (a 1-d tensor), and bf16 rows of 2 x 2.
  Tensor indices = Tensor::empty({3}, DType::I32);
  for (int i = 0; i < 3; ++i) indices.data<int32_t>()[i] = 7 - i;
  Tensor got = Tensor::zeros({3}, DType::I32);
  group->all_to_all(got, {3}, indices, {3});
  EXPECT_EQ(std::vector<int32_t>(got.data<int32_t>(), got.data<int32_t>() + 3), (std::vector<int32_t>{7, 6, 5}));
  Tensor tokens = Tensor::empty({2, 2, 2}, DType::BF16);
  for (int i = 0; i < 8; ++i) tokens.data<BFloat16>()[i] = to_bf16(0.5f * static_cast<float>(i));
  Tensor tokens_out = Tensor::zeros({2, 4}, DType::BF16);  // the same rows of 4 elements, another shape
  group->all_to_all(tokens_out, {2}, tokens, {2});
  for (int i = 0; i < 8; ++i) EXPECT_EQ(tokens_out.data<BFloat16>()[i].bits, tokens.data<BFloat16>()[i].bits);
  // Nothing to move, also with empty tensors.
  group->all_to_all(output, {0}, input, {0});
  EXPECT_EQ(values(output), expected);
  group->all_to_all(Tensor::zeros({0, 3}), {0}, Tensor::zeros({0, 3}), {0});
  auto sub = group->split(0, 0);
  Tensor sub_out = Tensor::zeros({5, 3});
  sub->all_to_all(sub_out, {5}, input, {5});
  EXPECT_EQ(values(sub_out), values(input));
  group->destroy();
  expect_error([&] { group->all_to_all(output, {1}, input, {1}); }, {"process group used after destroy()"});
}

TEST(ProcessGroupCpu, AllToAllArgumentsAreChecked) {
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  Tensor input = Tensor::zeros({4, 3});
  Tensor output = Tensor::zeros({4, 3});
  expect_error([&] { group->all_to_all(output, {4}, input, {3}); },
               {"all_to_all: rank 0 sends 3 rows to rank 0 (itself), which expects 4 from it"});
  expect_error([&] { group->all_to_all(output, {1}, input, {1, 0}); },
               {"all_to_all: send_counts has 2 entries, expected one per rank of the group (1)"});
  expect_error([&] { group->all_to_all(output, {}, input, {1}); },
               {"all_to_all: recv_counts has 0 entries, expected one per rank of the group (1)"});
  expect_error([&] { group->all_to_all(output, {-1}, input, {-1}); },
               {"all_to_all: send_counts[0] is -1, expected a row count >= 0"});
  expect_error([&] { group->all_to_all(output, {5}, input, {5}); },
               {"all_to_all: send_counts add up to 5 rows, but input [4, 3] has 4"});
  expect_error([&] { group->all_to_all(Tensor::zeros({2, 3}), {3}, input, {3}); },
               {"all_to_all: recv_counts add up to 3 rows, but output [2, 3] has 2"});
  expect_error([&] { group->all_to_all(Tensor::zeros({4, 3}, DType::BF16), {1}, input, {1}); },
               {"all_to_all: output is bf16, input f32"});
  expect_error([&] { group->all_to_all(Tensor::zeros({4, 2}), {1}, input, {1}); },
               {"all_to_all: output [4, 2] has rows of 2 elements, input [4, 3] of 3"});
  expect_error([&] { group->all_to_all(output, {1}, Tensor::zeros({}), {0}); },
               {"all_to_all: input is a scalar, expected rows along dim 0"});
  expect_error([&] { group->all_to_all(input.narrow(1, 3), {1}, input.narrow(0, 2), {1}); },
               {"all_to_all: output and input overlap"});
  expect_error([&] { group->all_to_all(output, {1}, Tensor(), {1}); }, {"all_to_all: input is undefined"});
  expect_error([] { check_all_to_all(Tensor::zeros({4}), {1, 2}, Tensor::zeros({4}), {2, 1}, 2, Device::CUDA); },
               {"all_to_all: output is on cpu, the process group on cuda"});
  check_all_to_all(Tensor::zeros({4}), {1, 2}, Tensor::zeros({4}), {2, 1}, 2, Device::CPU);  // valid
  expect_error([] { check_all_to_all(Tensor::zeros({4}), {1, 2}, Tensor::zeros({4}), {2, 1}, 3, Device::CPU); },
               {"all_to_all: send_counts has 2 entries, expected one per rank of the group (3)"});
}

void contains(const std::string& message, const std::string& fragment) {
  EXPECT_NE(message.find(fragment), std::string::npos) << "message: " << message << "\nlacks: " << fragment;
}

TEST(ProcessGroupCpu, SeveralRanksFormTheCpuGroup) {
  const int port = free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 10s;
  options.collective_timeout = 10s;
  const auto errors = run_ranks(3, [&](int r) {
    auto group = create_process_group(env_of(r, 3, port), options);
    if (group->rank() != r || group->world_size() != 3) throw Error("wrong rank or size");
    Tensor t = iota(4, static_cast<float>(r));  // r, r + 1, ...
    group->all_reduce(t, ReduceOp::Sum);
    if (values(t) != std::vector<float>{3, 6, 9, 12})
      throw Error(fmt::format("rank {}: all_reduce gave {}", r, values(t)));
    // The maximum: rank r holds 10 - 4 r, r, 2 r and a NaN on rank 1 alone (it wins).
    Tensor m = Tensor::empty({4});
    const float nan = std::numeric_limits<float>::quiet_NaN();
    const float mine_max[4] = {10.0f - 4.0f * static_cast<float>(r), static_cast<float>(r), 2.0f * static_cast<float>(r),
                               r == 1 ? nan : 1.0f};
    std::copy_n(mine_max, 4, m.data<float>());
    group->all_reduce(m, ReduceOp::Max);
    if (m.data<float>()[0] != 10 || m.data<float>()[1] != 2 || m.data<float>()[2] != 4 || !std::isnan(m.data<float>()[3]))
      throw Error(fmt::format("rank {}: all_reduce max gave {}", r, values(m)));
    // Ranks 0 and 2 form one group (ranked 2, 0 by the key), rank 1 another.
    auto sub = group->split(r % 2, -r);
    Tensor mine = iota(1, static_cast<float>(r));
    Tensor all = Tensor::zeros({sub->world_size()});
    sub->all_gather(all, mine);
    const std::vector<float> expected = r % 2 ? std::vector<float>{1} : std::vector<float>{2, 0};
    if (values(all) != expected) throw Error(fmt::format("rank {}: split group holds {}", r, values(all)));
    // The group's size sets reduce_scatter's chunks; a wrong size fails on the caller
    // alone, before anything is sent, so the ranks stay in step.
    const std::string wrong = fmt::format("input [3] must hold world size {} chunks", sub->world_size());
    try {
      sub->reduce_scatter(Tensor::zeros({2}), Tensor::zeros({3}), ReduceOp::Sum);
      throw Error("reduce_scatter with a wrong input size was accepted");
    } catch (const Error& e) {
      if (std::string(e.what()).find(wrong) == std::string::npos) throw;
    }
    group->barrier();
  });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
}

TEST(ProcessGroupCpu, AllToAllAcrossThreeRanksAndMismatchedCountsFailEveryRank) {
  const int port = free_port();
  ProcessGroupOptions options;
  options.rendezvous_timeout = 10s;
  options.collective_timeout = 10s;
  const auto errors = run_ranks(3, [&](int r) {
    auto group = create_process_group(env_of(r, 3, port), options);
    // Rank i sends i + j rows to rank j, row k of them holding 100 i + 10 j + k.
    std::vector<int64_t> send(3);
    std::vector<int64_t> recv(3);
    std::vector<float> rows;
    for (int j = 0; j < 3; ++j) {
      send[j] = r + j;
      recv[j] = j + r;
      for (int k = 0; k < r + j; ++k) rows.push_back(static_cast<float>(100 * r + 10 * j + k));
    }
    Tensor input = Tensor::empty({static_cast<int64_t>(rows.size())});
    std::copy(rows.begin(), rows.end(), input.data<float>());
    Tensor output = Tensor::zeros({3 * r + 3});
    group->all_to_all(output, recv, input, send);
    std::vector<float> expected;
    for (int i = 0; i < 3; ++i)
      for (int k = 0; k < i + r; ++k) expected.push_back(static_cast<float>(100 * i + 10 * r + k));
    if (values(output) != expected) throw Error(fmt::format("rank {}: all_to_all gave {}", r, values(output)));
    // Rank 2 expects one row more from rank 0 than rank 0 sends it.
    if (r == 2) recv[0] += 1;
    group->all_to_all(Tensor::zeros({3 * r + 4}), recv, input, send);
  });
  for (int r = 0; r < 3; ++r) {
    contains(errors[r], "all_to_all #2 (f32, rows of 1 elements) on the world: the ranks' row counts do not match");
    contains(errors[r], "rank 0 sends 2 rows to rank 2, which expects 3 from it");
  }
  contains(errors[1], "rank 1 of 3: rank 0 stopped the job");
}

TEST(ProcessGroupCpu, AFailureIsReportedOnceAndLasts) {
  const int port = free_port();
  std::mutex mu;
  std::vector<std::string> reported;
  ProcessGroupOptions options;
  options.rendezvous_timeout = 10s;
  options.collective_timeout = 300ms;
  options.on_failure = [&](const std::string& message) {
    std::lock_guard lock(mu);
    reported.push_back(message);
  };
  std::promise<void> rank0_failed;
  std::shared_future<void> failed = rank0_failed.get_future().share();
  std::string later;
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(2, [&](int r) {
    auto group = create_process_group(env_of(r, 2, port), options);
    if (r == 1) {
      failed.wait();  // stays connected, but late for rank 0's all_reduce
      group->barrier();
      return;
    }
    Tensor t = Tensor::zeros({8});
    try {
      group->all_reduce(t, ReduceOp::Sum);
    } catch (const Error&) {
      rank0_failed.set_value();
      try {
        group->split(0, 0);  // a failed group stays failed
      } catch (const Error& e) {
        later = e.what();
      }
      throw;
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  contains(errors[0],
           "rank 0 of 2: all_reduce #1 (f32, 8 elements, sum) on the world: rank 1 did not arrive within 0.3 s");
  EXPECT_EQ(later, errors[0]);
  contains(errors[1], "rank 1 of 2: rank 0 stopped the job: all_reduce #1");
  std::lock_guard lock(mu);
  EXPECT_EQ(reported.size(), 2u);
  EXPECT_NE(std::find(reported.begin(), reported.end(), errors[0]), reported.end());
  EXPECT_NE(std::find(reported.begin(), reported.end(), errors[1]), reported.end());
}

#ifndef FORGE_CUDA
TEST(ProcessGroupCpu, CudaNeedsTheCudaBackend) {
  ProcessGroupOptions cuda;
  cuda.device = Device::CUDA;
  expect_error([&] { create_process_group(env_of(1, 2, 29500), cuda); }, {"rank 1 of 2", "-DFORGE_CUDA=ON"});
}
#endif

}  // namespace
}  // namespace forge
