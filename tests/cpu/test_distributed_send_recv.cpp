// send_recv on the CPU (NOTE [Point-to-point] in distributed/process_group.h): the
// one-rank group copying its sends to itself, the argument checks every group shares, and
// the CPU group of several ranks, its ranks as threads of this process: a ring, neighbours
// exchanging both ways in one call, several sends to one peer in order, empty calls
// (ranks with nothing to move), bf16 and int32 moved bit-exactly, split groups exchanging
// at the same time, and pairings that do not match failing every rank of the group,
// naming the ops.
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "config_test_support.h"
#include "rank_threads.h"
#include "core/bf16.h"
#include "distributed/process_group.h"

namespace forge {
namespace {

using namespace std::chrono_literals;
using config_test::expect_error;
using testing::env_of;
using testing::floats;
using testing::free_port;
using testing::run_ranks;
using testing::values;
using Op = PointToPoint;

std::vector<uint8_t> bytes(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw());
  return {p, p + t.nbytes()};
}

void contains(const std::string& message, const std::string& fragment) {
  EXPECT_NE(message.find(fragment), std::string::npos) << "message: " << message << "\nlacks: " << fragment;
}

ProcessGroupOptions quick() {
  ProcessGroupOptions options;
  options.rendezvous_timeout = 10s;
  options.collective_timeout = 10s;
  return options;
}

// Throws naming the rank when `got` is not `expected`.
void expect_values(int rank, const char* what, const Tensor& got, const std::vector<float>& expected) {
  if (values(got) != expected)
    throw Error(fmt::format("rank {}: {} gave {}, expected {}", rank, what, values(got), expected));
}

TEST(SendRecvOneRank, CopiesItsSendsToItselfIntoItsReceives) {
  auto group = create_process_group(LaunchEnv{}, ProcessGroupOptions{});
  // Two sends to itself, received in order; the second pair differs in dtype and shape.
  Tensor a = floats({1, 2, 3});
  Tensor b = Tensor::empty({2, 2}, DType::BF16);
  for (int i = 0; i < 4; ++i) b.data<BFloat16>()[i].bits = static_cast<uint16_t>(0x7fc1 + 0x1000 * i);  // a NaN too
  Tensor got_a = Tensor::zeros({3});
  Tensor got_b = Tensor::zeros({2}, DType::I32);
  group->send_recv({Op::recv(0, got_a), Op::send(0, a), Op::send(0, b), Op::recv(0, got_b)});
  EXPECT_EQ(values(got_a), values(a));
  EXPECT_EQ(bytes(got_b), bytes(b));
  group->send_recv({});
  group->send_recv({Op::send(0, Tensor::zeros({0})), Op::recv(0, Tensor::zeros({0}, DType::BF16))});
  auto sub = group->split(0, 0);
  Tensor got = Tensor::zeros({3});
  sub->send_recv({Op::send(0, a), Op::recv(0, got)});
  EXPECT_EQ(values(got), values(a));

  expect_error([&] { group->send_recv({Op::send(0, a)}); },
               {"send_recv: rank 0's sends to itself do not pair up",
                "rank 0's op 0 sends 12 bytes to itself, which lists no receive from rank 0 for it"});
  expect_error([&] { group->send_recv({Op::recv(0, got)}); },
               {"rank 0's op 0 receives 12 bytes from itself, which lists no send to rank 0 for it"});
  expect_error([&] { group->send_recv({Op::send(0, a), Op::recv(0, Tensor::zeros({2}))}); },
               {"rank 0's op 0 sends 12 bytes to itself, whose op 1 receives 8 bytes"});
  expect_error([&] { group->send_recv({Op::send(1, a), Op::recv(1, got)}); },
               {"send_recv: op 0 (send to rank 1) names a rank outside the group of 1 (0..0)"});
  group->destroy();
  expect_error([&] { group->send_recv({}); }, {"process group used after destroy()"});
}

TEST(SendRecvArguments, AreCheckedNamingTheOp) {
  Tensor t = Tensor::zeros({8});
  Tensor other = Tensor::zeros({8});
  check_send_recv({Op::send(3, t), Op::recv(0, other), Op::send(0, t), Op::send(1, t)}, 4, Device::CPU);  // valid
  expect_error([&] { check_send_recv({Op::send(0, t), Op::recv(-1, other)}, 4, Device::CPU); },
               {"send_recv: op 1 (receive from rank -1) names a rank outside the group of 4 (0..3)"});
  expect_error([&] { check_send_recv({Op::send(4, t)}, 4, Device::CPU); },
               {"send_recv: op 0 (send to rank 4) names a rank outside the group of 4"});
  expect_error([&] { check_send_recv({Op::recv(1, Tensor())}, 4, Device::CPU); },
               {"send_recv: op 0 (receive from rank 1): its tensor is undefined"});
  expect_error([&] { check_send_recv({Op::send(1, t)}, 4, Device::CUDA); },
               {"send_recv: op 0 (send to rank 1): its tensor is on cpu, the process group on cuda"});
  expect_error([&] { check_send_recv({Op::send(1, other), Op::recv(2, t.narrow(0, 4)), Op::recv(3, t.narrow(3, 8))},
                                     4, Device::CPU); },
               {"send_recv: op 1 (receive from rank 2) receives into memory that op 2 (receive from rank 3) receives "
                "into too"});
  expect_error([&] { check_send_recv({Op::send(1, t.narrow(6, 8)), Op::recv(2, t.view({2, 4}).narrow(1, 2))}, 4,
                                     Device::CPU); },
               {"send_recv: op 1 (receive from rank 2) receives into memory that op 0 (send to rank 1) sends from"});
  // Sends may share memory (the same tensor to two peers), and adjacent receives touch.
  check_send_recv({Op::send(1, t), Op::send(2, t), Op::recv(1, other.narrow(0, 4)), Op::recv(2, other.narrow(4, 8)),
                   Op::recv(3, other.narrow(4, 4))},
                  4, Device::CPU);
}

TEST(SendRecvCpu, RingNeighboursAndOrderAcrossFourRanks) {
  const int port = free_port();
  const auto errors = run_ranks(4, [&](int r) {
    auto group = create_process_group(env_of(r, 4, port), quick());
    const int next = (r + 1) % 4;
    const int prev = (r + 3) % 4;
    const float me = static_cast<float>(r);
    // A ring: every rank sends to the next and receives from the previous, in one call.
    Tensor from_prev = Tensor::zeros({2});
    group->send_recv({Op::send(next, floats({me, 10 * me})), Op::recv(prev, from_prev)});
    expect_values(r, "the ring", from_prev, {static_cast<float>(prev), 10.0f * static_cast<float>(prev)});
    // Both ways to both neighbours in one call, receives listed before sends.
    Tensor left = Tensor::zeros({1});
    Tensor right = Tensor::zeros({3});
    group->send_recv({Op::recv(prev, left), Op::recv(next, right), Op::send(next, floats({me})),
                      Op::send(prev, floats({me, me, me}))});
    expect_values(r, "from the left", left, {static_cast<float>(prev)});
    expect_values(r, "from the right", right, std::vector<float>(3, static_cast<float>(next)));
    // Several sends to one peer arrive in their order, into receives of other sizes each.
    // Ranks 1 and 3 have nothing to move: their calls are empty.
    if (r == 0) {
      group->send_recv({Op::send(2, floats({1})), Op::send(2, floats({2, 3})), Op::send(2, floats({4, 5, 6}))});
    } else if (r == 2) {
      Tensor first = Tensor::zeros({1});
      Tensor second = Tensor::zeros({2});
      Tensor third = Tensor::zeros({3});
      group->send_recv({Op::recv(0, first), Op::recv(0, second), Op::recv(0, third)});
      expect_values(r, "the first send", first, {1});
      expect_values(r, "the second send", second, {2, 3});
      expect_values(r, "the third send", third, {4, 5, 6});
    } else {
      group->send_recv({});
    }
    group->send_recv({});  // every rank empty
    // bf16 (every bit pattern of a range, NaNs among them) and int32 move bit-exactly,
    // here rank r to rank 3 - r, sending to itself nothing.
    Tensor b = Tensor::empty({256}, DType::BF16);
    for (int i = 0; i < 256; ++i) b.data<BFloat16>()[i].bits = static_cast<uint16_t>(0x7f00 + 256 * r + i);
    Tensor n = Tensor::empty({5}, DType::I32);
    for (int i = 0; i < 5; ++i) n.data<int32_t>()[i] = (r + 1) * (i % 2 ? -1 : 1) * (1 << (6 * i));
    Tensor got_b = Tensor::zeros({16, 16}, DType::BF16);
    Tensor got_n = Tensor::zeros({5}, DType::I32);
    const int peer = 3 - r;
    group->send_recv({Op::send(peer, b), Op::send(peer, n), Op::recv(peer, got_b), Op::recv(peer, got_n)});
    for (int i = 0; i < 256; ++i)
      if (got_b.data<BFloat16>()[i].bits != static_cast<uint16_t>(0x7f00 + 256 * peer + i))
        throw Error(fmt::format("rank {}: bf16 element {} arrived as {:#x}", r, i, got_b.data<BFloat16>()[i].bits));
    for (int i = 0; i < 5; ++i)
      if (got_n.data<int32_t>()[i] != (peer + 1) * (i % 2 ? -1 : 1) * (1 << (6 * i)))
        throw Error(fmt::format("rank {}: int32 element {} arrived as {}", r, i, got_n.data<int32_t>()[i]));
    // A send to itself with its receive, next to the others; then the other collectives
    // go on in step.
    Tensor own = Tensor::zeros({1});
    group->send_recv({Op::send(r, floats({me})), Op::recv(r, own), Op::send(next, floats({me})),
                      Op::recv(prev, from_prev.narrow(0, 1))});
    expect_values(r, "to itself", own, {me});
    Tensor sum = floats({me});
    group->all_reduce(sum, ReduceOp::Sum);
    expect_values(r, "all_reduce after send_recv", sum, {6});
    group->barrier();
  });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
}

TEST(SendRecvCpu, SplitGroupsExchangeAtTheSameTime) {
  const int port = free_port();
  const auto errors = run_ranks(4, [&](int r) {
    auto world = create_process_group(env_of(r, 4, port), quick());
    // Groups {3, 1} and {2, 0} (world ranks, in group rank order: keyed by -r), so group
    // ranks are not world ranks.
    auto group = world->split(r % 2, -r);
    if (group->world_size() != 2 || group->rank() != (r < 2 ? 1 : 0))
      throw Error(fmt::format("rank {}: wrong split", r));
    const int other = 1 - group->rank();
    Tensor got = Tensor::zeros({2});
    group->send_recv({Op::send(other, floats({static_cast<float>(r), 100})), Op::recv(other, got)});
    const float partner = static_cast<float>(r < 2 ? r + 2 : r - 2);
    expect_values(r, "the split group", got, {partner, 100});
    // One group exchanges while the other's call is empty; then the world's turn.
    if (r % 2 == 0) {
      group->send_recv({Op::send(other, floats({static_cast<float>(r)})), Op::recv(other, got.narrow(0, 1))});
      expect_values(r, "the even group", got, {partner, 100});
    } else {
      group->send_recv({});
    }
    Tensor from = Tensor::zeros({1});
    world->send_recv({Op::send((r + 1) % 4, floats({static_cast<float>(r)})), Op::recv((r + 3) % 4, from)});
    expect_values(r, "the world after the split", from, {static_cast<float>((r + 3) % 4)});
    // A mismatch in one group fails its ranks, naming world ranks: world rank 3 (group
    // rank 0 of {3, 1}) sends 4 bytes more than world rank 1 receives. The other group,
    // with its own connections, exchanges as it should.
    Tensor big = Tensor::zeros({r == 3 ? 2 : 1});
    group->send_recv({Op::send(other, big), Op::recv(other, Tensor::zeros({1}))});
  });
  for (int r : {1, 3}) {
    contains(errors[r], "send_recv #3 on group 2 (world ranks 3, 1): the ranks' sends and receives do not pair up");
    contains(errors[r], "rank 3's op 0 sends 8 bytes to rank 1, whose op 1 receives 4 bytes");
  }
  contains(errors[1], "rank 1 of 4: rank 3 stopped the job");
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[2], "");
}

TEST(SendRecvCpu, ASendWithoutItsReceiveFailsEveryRank) {
  const int port = free_port();
  const auto errors = run_ranks(3, [&](int r) {
    auto group = create_process_group(env_of(r, 3, port), quick());
    // Rank 0 sends to rank 2 twice; rank 2 receives once. Rank 1 receives from rank 2,
    // which sends it nothing.
    Tensor t = Tensor::zeros({4});
    if (r == 0) group->send_recv({Op::send(2, t), Op::send(2, t)});
    if (r == 1) group->send_recv({Op::recv(2, t)});
    if (r == 2) group->send_recv({Op::recv(0, t)});
  });
  for (int r = 0; r < 3; ++r) {
    contains(errors[r], "rank " + std::to_string(r) + " of 3");
    contains(errors[r], "send_recv #1 on the world: the ranks' sends and receives do not pair up");
    contains(errors[r], "rank 0's op 1 sends 16 bytes to rank 2, which lists no receive from rank 0 for it");
    contains(errors[r], "rank 1's op 0 receives 16 bytes from rank 2, which lists no send to rank 1 for it");
  }
  contains(errors[1], "rank 0 stopped the job");
}

TEST(SendRecvCpu, DifferentByteCountsFailEveryRank) {
  const int port = free_port();
  const auto errors = run_ranks(2, [&](int r) {
    auto group = create_process_group(env_of(r, 2, port), quick());
    Tensor t = Tensor::zeros({2});
    group->send_recv({Op::send(1 - r, t), Op::recv(1 - r, Tensor::zeros({2}))});  // fine
    // Rank 1 receives 6 bf16 (12 bytes) where rank 0 sends 2 floats (8 bytes).
    Tensor in = r == 0 ? Tensor::zeros({2}) : Tensor::zeros({6}, DType::BF16);
    group->send_recv({Op::send(1 - r, t), Op::recv(1 - r, in)});
  });
  for (int r = 0; r < 2; ++r) {
    contains(errors[r], "send_recv #2 on the world: the ranks' sends and receives do not pair up");
    contains(errors[r], "rank 0's op 0 sends 8 bytes to rank 1, whose op 1 receives 12 bytes");
  }
  // Rank 1's send to rank 0 pairs (8 bytes each): it is not named.
  EXPECT_EQ(errors[0].find("rank 1's op 0"), std::string::npos) << errors[0];
}

TEST(SendRecvCpu, AnArgumentErrorFailsTheCallingRankBeforeAnythingIsSent) {
  const int port = free_port();
  const auto errors = run_ranks(2, [&](int r) {
    auto group = create_process_group(env_of(r, 2, port), quick());
    Tensor t = Tensor::zeros({4});
    // Both fail alone, before the round; so the ranks stay in step.
    if (r == 0) expect_error([&] { group->send_recv({Op::send(2, t)}); }, {"op 0 (send to rank 2) names a rank"});
    if (r == 1)
      expect_error([&] { group->send_recv({Op::recv(0, t.narrow(0, 3)), Op::recv(0, t.narrow(2, 4))}); },
                   {"op 0 (receive from rank 0) receives into memory that op 1"});
    Tensor got = Tensor::zeros({4});
    group->send_recv({Op::send(1 - r, floats({1, 2, 3, 4})), Op::recv(1 - r, got)});
    expect_values(r, "after the argument errors", got, {1, 2, 3, 4});
  });
  for (const std::string& error : errors) EXPECT_EQ(error, "");
}

}  // namespace
}  // namespace forge
