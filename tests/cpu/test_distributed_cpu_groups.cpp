// Groups split from the CPU process group run on connections of their own (NOTE [CPU
// process group]), its ranks as threads of this process: two groups making different
// calls at different moments, as the stages of a pipeline do; a split of a split; a
// mismatch failing its group alone, naming world ranks; a member that never calls named
// by the others of its group after the timeout.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <chrono>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "rank_threads.h"
#include "distributed/process_group.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using testing::env_of;
using testing::floats;
using testing::free_port;
using testing::run_ranks;
using testing::values;
using Op = PointToPoint;

void expect_values(int r, const char* what, const Tensor& t, const std::vector<float>& expected) {
  if (values(t) != expected)
    throw Error(fmt::format("rank {}: {} gave {}, expected {}", r, what, values(t), expected));
}

void contains(const std::string& message, const std::string& fragment) {
  EXPECT_NE(message.find(fragment), std::string::npos) << "message: " << message << "\nlacks: " << fragment;
}

ProcessGroupOptions options(std::chrono::milliseconds collective_timeout) {
  ProcessGroupOptions o;
  o.rendezvous_timeout = 10s;
  o.collective_timeout = collective_timeout;
  return o;
}

TEST(CpuGroups, TwoGroupsMakeDifferentCallsAtDifferentMoments) {
  const int port = free_port();
  const auto errors = run_ranks(4, [&](int r) {
    auto world = create_process_group(env_of(r, 4, port), options(10s));
    auto group = world->split(r / 2, 0);  // A = {0, 1}, B = {2, 3}
    const float me = static_cast<float>(r);
    if (r < 2) {
      // Three all_reduces, all done before B starts (B waits for nothing of A's).
      for (int i = 1; i <= 3; ++i) {
        Tensor t = floats({me * static_cast<float>(i), 1});
        group->all_reduce(t, ReduceOp::Sum);
        expect_values(r, "group A's all_reduce", t, {static_cast<float>(i), 2});
      }
    } else {
      std::this_thread::sleep_for(100ms);
      Tensor all = Tensor::zeros({4});
      group->all_gather(all, floats({me, 10 * me}));
      expect_values(r, "group B's all_gather", all, {2, 20, 3, 30});
      const int other = 1 - group->rank();
      for (int i = 0; i < 2; ++i) {
        Tensor got = Tensor::zeros({1});
        group->send_recv({Op::send(other, floats({me + static_cast<float>(i)})), Op::recv(other, got)});
        expect_values(r, "group B's send_recv", got, {static_cast<float>(5 - r + i)});
      }
    }
    world->barrier();
    Tensor sum = floats({me});
    world->all_reduce(sum, ReduceOp::Sum);
    expect_values(r, "the world's all_reduce", sum, {6});
  });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
}

TEST(CpuGroups, ASplitOfASplitRunsOnItsOwn) {
  const int port = free_port();
  const auto errors = run_ranks(4, [&](int r) {
    auto world = create_process_group(env_of(r, 4, port), options(10s));
    auto half = world->split(r / 2, 0);  // {0, 1}, {2, 3}
    auto reversed = half->split(0, -half->rank());  // {1, 0}, {3, 2}
    auto alone = half->split(half->rank(), 0);  // one rank each
    if (reversed->world_size() != 2 || reversed->rank() != 1 - r % 2 || alone->world_size() != 1)
      throw Error(fmt::format("rank {}: wrong split", r));
    const float me = static_cast<float>(r);
    if (r < 2) {
      for (int i = 0; i < 2; ++i) {
        Tensor all = Tensor::zeros({2});
        reversed->all_gather(all, floats({me + static_cast<float>(10 * i)}));
        expect_values(r, "all_gather on the reversed pair", all, {1 + 10.0f * i, 10.0f * i});
      }
    } else {
      Tensor got = Tensor::zeros({1});
      const int other = 1 - reversed->rank();
      reversed->send_recv({Op::send(other, floats({me})), Op::recv(other, got)});
      expect_values(r, "send_recv on the reversed pair", got, {static_cast<float>(5 - r)});
      Tensor t = floats({me, 1});
      alone->all_reduce(t, ReduceOp::Avg);
      expect_values(r, "all_reduce on a group of one", t, {me, 1});
    }
    Tensor sum = floats({me});
    half->all_reduce(sum, ReduceOp::Sum);
    expect_values(r, "the half's all_reduce", sum, {r < 2 ? 1.0f : 5.0f});
    world->barrier();
  });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
}

// A mismatch in group {2, 3} fails its ranks alone: group {0, 1} goes on. The failed ranks'
// later calls on any group throw that failure at once; the world's other ranks learn of
// it when they next wait for them (here the world's barrier, after its timeout).
TEST(CpuGroups, AMismatchFailsItsGroupAlone) {
  const int port = free_port();
  std::latch others_done(2);
  std::vector<std::string> later(4);
  const auto errors = run_ranks(4, [&](int r) {
    auto world = create_process_group(env_of(r, 4, port), options(500ms));
    auto group = world->split(r / 2, 0);
    Tensor t = Tensor::zeros({r == 3 ? 2 : 1});
    try {
      group->all_reduce(t, ReduceOp::Sum);
    } catch (const Error&) {
      try {
        world->barrier();
      } catch (const Error& e) {
        later[r] = e.what();
      }
      others_done.wait();  // the connections stay open, so the others' wait is a timeout
      throw;
    }
    try {
      world->barrier();
    } catch (const Error&) {
      others_done.count_down();
      throw;
    }
  });
  for (int r : {2, 3}) {
    contains(errors[r], fmt::format("rank {} of 4: ", r));
    contains(errors[r],
             "collectives do not match across ranks: rank 2 called all_reduce #1 (f32, 1 elements, sum) on group 2 "
             "(world ranks 2-3); rank 3 called all_reduce #1 (f32, 2 elements, sum) on group 2 (world ranks 2-3)");
    EXPECT_EQ(later[r], errors[r]);
  }
  contains(errors[3], "rank 3 of 4: rank 2 stopped the job");
  contains(errors[0], "rank 0 of 4: barrier #2 on the world: ranks 2-3 did not arrive within 0.5 s (2 of 4 ranks did)");
  contains(errors[1], "rank 1 of 4: rank 0 stopped the job: barrier #2 on the world: ranks 2-3 did not arrive");
}

// Groups {1, 0} and {3, 2} (keyed by -r): world rank 2 (group rank 1) never calls, and is
// named by world rank 3 (the group's rank 0); world rank 1, group {1, 0}'s rank 0, never
// calls, and world rank 0 hears nothing from it.
TEST(CpuGroups, AMemberThatNeverCallsIsNamedByItsGroup) {
  const int port = free_port();
  std::latch callers_done(2);
  const auto start = std::chrono::steady_clock::now();
  const auto errors = run_ranks(4, [&](int r) {
    auto world = create_process_group(env_of(r, 4, port), options(300ms));
    auto group = world->split(r / 2, -r);
    if (r == 1 || r == 2) {
      callers_done.wait();  // connected, but silent
      return;
    }
    try {
      Tensor t = Tensor::zeros({4});
      group->all_reduce(t, ReduceOp::Sum);
    } catch (const Error&) {
      callers_done.count_down();
      throw;
    }
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(errors[1], "");
  EXPECT_EQ(errors[2], "");
  contains(errors[3],
           "rank 3 of 4: all_reduce #1 (f32, 4 elements, sum) on group 2 (world ranks 3, 2): rank 2 did not arrive "
           "within 0.3 s (1 of 2 ranks did)");
  contains(errors[0], "rank 0 of 4: all_reduce #1 (f32, 4 elements, sum) on group 1 (world ranks 1, 0): no word from "
                      "rank 1 at ");
}

}  // namespace
}  // namespace forge
