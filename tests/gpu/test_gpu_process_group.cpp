// The NCCL process group on known data, for any number of ranks. Alone (scripts/gpu-test)
// it is a group of one; on a machine with several GPUs, run every rank of it with
//
//   build-cuda/forge launch --nproc-per-node 2 -- build-cuda/tests/forge_gpu_tests --gtest_filter='*ProcessGroup*'
//
// Every rank runs the same tests in the same order, so their collectives pair up. Rank r
// contributes (r + 1) x a small integer pattern, so sums and gathers have one exact
// answer to compare with (bf16 sums are checked to bf16 precision: the order in which
// NCCL adds may round differently once sums pass 256). The failure test (two or more
// ranks) leaves rank 0 alone in an all-reduce and expects it ended within the timeout,
// with a message naming rank 0 and the collective: by the watchdog when the kernel was
// launched, or by the enqueue itself while NCCL still waits to connect to the absent peer
// (the first collective on a communicator connects lazily). Whatever its outcome, every
// rank reaches the test's closing barrier, so one failed expectation cannot hang the job.
// The all_to_all test has rank i send (i + 2 j + 3) % 4 rows to rank j (zeros and self-sends
// included; alone, a copy of its rows to itself), bf16 token rows and int32 index rows,
// and compares the bytes received, spare output rows untouched included.
// The split test makes a group of each parity (its own communicator) and checks that both
// reduce and gather within themselves, in the order the keys give.
// scripts/gpu-test-dist runs this on every GPU and prints a pass/fail line per rank.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/bf16.h"
#include "distributed/launch_env.h"
#include "distributed/process_group.h"
#include "gpu_testing.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using gpu_test::poisoned_gpu;
using gpu_test::to_cpu_f32;
using gpu_test::to_gpu;

// One group for the whole test program: NCCL setup takes a while. Destroyed after the
// last test, while CUDA is still up. A failed setup is not tried again: the other ranks
// would wait out the rendezvous timeout once per test.
class GroupEnvironment : public ::testing::Environment {
 public:
  static ProcessGroup& group() {
    if (!instance_->group_) {
      if (!instance_->failure_.empty()) throw Error("process group setup failed earlier: " + instance_->failure_);
      ProcessGroupOptions options;
      options.device = Device::CUDA;
      options.rendezvous_timeout = 120s;
      options.collective_timeout = 60s;
      try {
        instance_->group_ = create_process_group(read_launch_env(), options);
      } catch (const Error& e) {
        instance_->failure_ = e.what();
        throw;
      }
    }
    return *instance_->group_;
  }
  void TearDown() override { group_.reset(); }

  static GroupEnvironment* instance_;

 private:
  std::unique_ptr<ProcessGroup> group_;
  std::string failure_;
};

GroupEnvironment* GroupEnvironment::instance_ =
    static_cast<GroupEnvironment*>(::testing::AddGlobalTestEnvironment(new GroupEnvironment));

// Small integers 1..7, so that every value and every sum of a few ranks is exact.
float pattern(int64_t i) { return static_cast<float>(i % 7 + 1); }

Tensor host_values(int64_t n, const std::function<float(int64_t)>& value) {
  Tensor t = Tensor::empty({n});
  for (int64_t i = 0; i < n; ++i) t.data<float>()[i] = value(i);
  return t;
}

void expect_values(const Tensor& gpu, const std::function<float(int64_t)>& expected, DType dtype, const char* what) {
  const Tensor got = to_cpu_f32(gpu);
  const double tolerance = dtype == DType::BF16 ? 1e-2 : 1e-6;
  int reported = 0;
  for (int64_t i = 0; i < got.numel() && reported < 5; ++i) {
    const float want = expected(i);
    const float have = got.data<float>()[i];
    if (!(std::abs(have - want) <= tolerance * std::abs(want))) {
      ADD_FAILURE() << what << " (" << dtype_name(dtype) << "): element " << i << " is " << have << ", expected "
                    << want;
      ++reported;
    }
  }
}

constexpr DType kDtypes[] = {DType::F32, DType::BF16};

TEST(ProcessGroupCollectives, AllReduceSumsAndAverages) {
  ProcessGroup& g = GroupEnvironment::group();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const int world = g.world_size();
    const float rank_factor = static_cast<float>(g.rank() + 1);
    const float factor_sum = world * (world + 1) / 2.0f;
    for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{1} << 20}) {
      Tensor sum = to_gpu(host_values(n, [&](int64_t i) { return rank_factor * pattern(i); }), dtype);
      g.all_reduce(sum, ReduceOp::Sum);
      expect_values(
          sum, [&](int64_t i) { return factor_sum * pattern(i); }, dtype, "all_reduce sum");

      Tensor avg = to_gpu(host_values(n, [&](int64_t i) { return rank_factor * pattern(i); }), dtype);
      g.all_reduce(avg, ReduceOp::Avg);
      expect_values(
          avg, [&](int64_t i) { return factor_sum / world * pattern(i); }, dtype, "all_reduce avg");
    }
  }
}

TEST(ProcessGroupCollectives, ReduceScatterGivesEachRankItsChunk) {
  ProcessGroup& g = GroupEnvironment::group();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const int world = g.world_size();
    const float rank_factor = static_cast<float>(g.rank() + 1);
    const float factor_sum = world * (world + 1) / 2.0f;
    const int64_t chunk = 4099;
    Tensor input = to_gpu(host_values(chunk * world, [&](int64_t j) { return rank_factor * pattern(j); }), dtype);
    Tensor output = poisoned_gpu({chunk}, dtype);
    g.reduce_scatter(output, input, ReduceOp::Sum);
    expect_values(
        output, [&](int64_t i) { return factor_sum * pattern(g.rank() * chunk + i); }, dtype, "reduce_scatter sum");
    g.reduce_scatter(output, input, ReduceOp::Avg);
    expect_values(
        output, [&](int64_t i) { return factor_sum / world * pattern(g.rank() * chunk + i); }, dtype,
        "reduce_scatter avg");
  }
}

TEST(ProcessGroupCollectives, AllGatherConcatenatesInRankOrder) {
  ProcessGroup& g = GroupEnvironment::group();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    const int world = g.world_size();
    const int64_t chunk = 3001;
    Tensor input = to_gpu(host_values(chunk, [&](int64_t i) { return float(g.rank() + 1) * pattern(i); }), dtype);
    Tensor output = poisoned_gpu({world * chunk}, dtype);
    g.all_gather(output, input);
    expect_values(
        output, [&](int64_t j) { return float(j / chunk + 1) * pattern(j % chunk); }, dtype, "all_gather");
  }
}

TEST(ProcessGroupCollectives, WorkOnTheCallersStream) {
  ProcessGroup& g = GroupEnvironment::group();
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    cudaStream_t stream = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
    Tensor t = to_gpu(host_values(777, [&](int64_t i) { return float(g.rank() + 1) * pattern(i); }), dtype);
    g.all_reduce(t, ReduceOp::Sum, stream);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const float factor_sum = g.world_size() * (g.world_size() + 1) / 2.0f;
    expect_values(
        t, [&](int64_t i) { return factor_sum * pattern(i); }, dtype, "all_reduce on a stream");
    g.barrier();
    cudaStreamDestroy(stream);
  }
}

// Element e of row k that rank `from` sends rank `to`, as raw bits: a bf16 small integer
// (exact) or an int32 that names all four.
uint32_t all_to_all_bits(DType dtype, int from, int to, int64_t k, int64_t e) {
  if (dtype == DType::BF16) return to_bf16(static_cast<float>((from * 31 + to * 7 + k * 3 + e) % 250)).bits;
  return static_cast<uint32_t>(from * 1000000 + to * 10000 + k * 100 + e);
}

TEST(ProcessGroupCollectives, AllToAllMovesRowsWithVariableCounts) {
  ProcessGroup& g = GroupEnvironment::group();
  const int world = g.world_size();
  const int me = g.rank();
  const auto count = [](int i, int j) { return static_cast<int64_t>((i + 2 * j + 3) % 4); };
  for (DType dtype : {DType::BF16, DType::I32}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    for (int64_t width : {int64_t{1}, int64_t{4096}}) {
      std::vector<int64_t> send(world);
      std::vector<int64_t> recv(world);
      int64_t sent = 0;
      int64_t received = 0;
      for (int j = 0; j < world; ++j) {
        send[j] = count(me, j);
        recv[j] = count(j, me);
        sent += send[j];
        received += recv[j];
      }
      const int64_t spare = 1;
      const size_t element = dtype_size(dtype);
      const auto put = [&](Tensor& t, int64_t index, uint32_t bits) {
        std::memcpy(static_cast<uint8_t*>(t.raw()) + index * element, &bits, element);
      };
      Tensor input = Tensor::zeros({sent + spare, width}, dtype);
      int64_t row = 0;
      for (int j = 0; j < world; ++j)
        for (int64_t k = 0; k < send[j]; ++k, ++row)
          for (int64_t e = 0; e < width; ++e) put(input, row * width + e, all_to_all_bits(dtype, me, j, k, e));
      Tensor expected = Tensor::empty({received + spare, width}, dtype);
      std::memset(expected.raw(), 0xff, expected.nbytes());  // as poisoned_gpu
      row = 0;
      for (int i = 0; i < world; ++i)
        for (int64_t k = 0; k < recv[i]; ++k, ++row)
          for (int64_t e = 0; e < width; ++e) put(expected, row * width + e, all_to_all_bits(dtype, i, me, k, e));
      Tensor output = poisoned_gpu({received + spare, width}, dtype);
      g.all_to_all(output, recv, input.to(Device::CUDA), send);
      const Tensor got = output.to(Device::CPU);
      ASSERT_EQ(got.nbytes(), expected.nbytes());
      EXPECT_EQ(std::memcmp(got.raw(), expected.raw(), got.nbytes()), 0)
          << "rows of " << width << ": " << received << " rows received, then " << spare << " spare";
      // Nothing to move: a valid call that leaves the output as it was.
      g.all_to_all(output, std::vector<int64_t>(world, 0), input.to(Device::CUDA), std::vector<int64_t>(world, 0));
      const Tensor again = output.to(Device::CPU);
      EXPECT_EQ(std::memcmp(again.raw(), expected.raw(), again.nbytes()), 0);
    }
  }
  // Refused on the calling rank before anything is enqueued.
  Tensor rows = Tensor::zeros({4, 2}, DType::BF16, Device::CUDA);
  EXPECT_THROW(g.all_to_all(Tensor::zeros({4, 2}, DType::I32, Device::CUDA), std::vector<int64_t>(world, 0), rows,
                            std::vector<int64_t>(world, 0)),
               Error);
  EXPECT_THROW(g.all_to_all(Tensor::zeros({4, 2}, DType::BF16, Device::CUDA), std::vector<int64_t>(world, 5), rows,
                            std::vector<int64_t>(world, 5)),
               Error);
  g.barrier();
}

TEST(ProcessGroupSplit, HalvesWorkAtOnceEachWithinItself) {
  ProcessGroup& g = GroupEnvironment::group();
  const int world = g.world_size();
  const int rank = g.rank();
  // Halves by parity, the key reversing the rank order within each (world 1: a group of one).
  auto half = g.split(rank % 2, world - rank);
  std::vector<int> members;
  for (int r = world - 1; r >= 0; --r)
    if (r % 2 == rank % 2) members.push_back(r);
  ASSERT_EQ(half->world_size(), static_cast<int>(members.size()));
  ASSERT_EQ(members[half->rank()], rank);
  float factor_sum = 0;
  for (int m : members) factor_sum += static_cast<float>(m + 1);
  for (DType dtype : kDtypes) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Tensor sum = to_gpu(host_values(5000, [&](int64_t i) { return float(rank + 1) * pattern(i); }), dtype);
    half->all_reduce(sum, ReduceOp::Sum);
    expect_values(
        sum, [&](int64_t i) { return factor_sum * pattern(i); }, dtype, "all_reduce on a split group");
    const int64_t chunk = 777;
    Tensor input = to_gpu(host_values(chunk, [&](int64_t i) { return float(rank + 1) * pattern(i); }), dtype);
    Tensor output = poisoned_gpu({chunk * half->world_size()}, dtype);
    half->all_gather(output, input);
    expect_values(
        output, [&](int64_t j) { return float(members[j / chunk] + 1) * pattern(j % chunk); }, dtype,
        "all_gather on a split group (members in key order)");
  }
  half->barrier();
  half->destroy();
  g.barrier();
}

TEST(ProcessGroupChecks, BarriersAndBadArguments) {
  ProcessGroup& g = GroupEnvironment::group();
  for (int i = 0; i < 3; ++i) g.barrier();
  const int world = g.world_size();
  Tensor f32 = Tensor::zeros({8}, DType::F32, Device::CUDA);
  Tensor i32 = Tensor::zeros({8}, DType::I32, Device::CUDA);
  Tensor cpu = Tensor::zeros({8});
  Tensor wrong = Tensor::zeros({8 * world + 1}, DType::F32, Device::CUDA);
  EXPECT_THROW(g.all_reduce(i32, ReduceOp::Sum), Error);
  EXPECT_THROW(g.all_reduce(cpu, ReduceOp::Sum), Error);
  EXPECT_THROW(g.reduce_scatter(f32, wrong, ReduceOp::Sum), Error);
  EXPECT_THROW(g.all_gather(wrong, f32), Error);
  g.barrier();  // the refused calls issued nothing, so the ranks are still in step
}

TEST(ProcessGroupFailure, WatchdogEndsACollectiveWhosePeerNeverComes) {
  ProcessGroup& main_group = GroupEnvironment::group();
  if (main_group.world_size() < 2) GTEST_SKIP() << "needs two or more ranks (forge launch --nproc-per-node 2)";
  std::mutex mu;
  std::string message;
  ProcessGroupOptions options;
  options.device = Device::CUDA;
  options.rendezvous_timeout = 120s;
  options.collective_timeout = 3s;
  options.on_failure = [&](const std::string& m) {
    std::lock_guard lock(mu);
    message = m;
  };
  auto group = create_process_group(read_launch_env(), options);
  if (group->rank() != 0) {
    // Stay out of the all-reduce, but alive, until rank 0 is done waiting for us.
    main_group.barrier();
    try {
      group->destroy();
    } catch (const Error&) {
      // Rank 0 aborted its end of the communicator, so tearing down ours may fail too.
    }
    return;
  }
  Tensor t = Tensor::zeros({1024}, DType::F32, Device::CUDA);
  const auto start = std::chrono::steady_clock::now();
  // No other rank joins. The all-reduce itself throws when NCCL never got to launch it
  // (still connecting to the absent peer); otherwise the barrier after it does.
  EXPECT_THROW(
      {
        group->all_reduce(t, ReduceOp::Sum);
        group->barrier();
      },
      Error);
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(waited, 30.0);
  {
    std::lock_guard lock(mu);
    EXPECT_NE(message.find("rank 0 of"), std::string::npos) << message;
    EXPECT_NE(message.find("all_reduce #1"), std::string::npos) << message;
    EXPECT_NE(message.find("did not complete within 3 s"), std::string::npos) << message;
  }
  EXPECT_THROW(group->all_reduce(t, ReduceOp::Sum), Error);  // a failed group stays failed
  EXPECT_NO_THROW(group->destroy());  // a failed group's destroy only releases what is left
  // The aborted kernel, if one was launched, has ended: the default stream drains (bounded).
  cudaEvent_t drained = nullptr;
  EXPECT_EQ(cudaEventCreateWithFlags(&drained, cudaEventDisableTiming), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(drained, nullptr), cudaSuccess);
  const auto drain_deadline = std::chrono::steady_clock::now() + 20s;
  while (cudaEventQuery(drained) == cudaErrorNotReady && std::chrono::steady_clock::now() < drain_deadline)
    std::this_thread::sleep_for(1ms);
  EXPECT_EQ(cudaEventQuery(drained), cudaSuccess) << "the default stream did not drain after the abort";
  cudaEventDestroy(drained);
  main_group.barrier();
}

}  // namespace
}  // namespace forge
