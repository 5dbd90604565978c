// The TCP rendezvous on localhost, one thread per rank on a free port: the NCCL id
// exchange and barriers succeed in any start order, and every way a job can be broken (a
// rank that never comes, a wrong world size, another protocol version, a rank that dies,
// a stranger on the port) ends every waiting rank with a message naming the cause, within
// the timeout. The messages of the CPU process group (NOTE [TCP messages]): many frames
// long, both ways, sizes checked, and rank 0's verdict reaching a rank that is stuck
// sending.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <future>
#include <thread>

#include "core/error.h"
#include "distributed/tcp_socket.h"
#include "distributed/tcp_store.h"

namespace forge {
namespace {

using namespace std::chrono_literals;

int free_port() { return net::bound_port(net::listen_tcp(0)); }

LaunchEnv env_of(int rank, int world, int port) {
  LaunchEnv e;
  e.rank = rank;
  e.world_size = world;
  e.local_rank = rank;
  e.local_world_size = world;
  e.master_addr = "localhost";
  e.master_port = port;
  e.launcher = Launcher::Torchrun;
  return e;
}

// Runs `body` as rank `rank` on its own thread; the future holds the error message, or ""
// when the rank finished without one.
std::future<std::string> start_rank(std::function<void()> body) {
  return std::async(std::launch::async, [body = std::move(body)]() -> std::string {
    try {
      body();
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  });
}

std::array<uint8_t, 128> id_pattern() {
  std::array<uint8_t, 128> id;
  for (size_t i = 0; i < id.size(); ++i) id[i] = static_cast<uint8_t>(i * 7 + 3);
  return id;
}

void contains(const std::string& message, const std::string& fragment) {
  EXPECT_NE(message.find(fragment), std::string::npos) << "message: " << message << "\nlacks: " << fragment;
}

TEST(TcpStore, ExchangesTheIdAndMeetsAtBarriersWhateverTheStartOrder) {
  const int port = free_port();
  const int world = 4;
  std::vector<std::future<std::string>> ranks;
  // Peers start first and keep retrying until rank 0 listens.
  for (int r = world - 1; r >= 0; --r) {
    ranks.push_back(start_rank([=] {
      if (r == 0) std::this_thread::sleep_for(300ms);
      TcpStore store(env_of(r, world, port), 10s);
      std::array<uint8_t, 128> id{};
      if (r == 0) id = id_pattern();
      store.broadcast(id);
      if (id != id_pattern()) throw Error("rank " + std::to_string(r) + " received other bytes");
      for (int i = 0; i < 3; ++i) store.barrier();
      store.broadcast(id);
    }));
  }
  for (auto& rank : ranks) EXPECT_EQ(rank.get(), "");
}

TEST(TcpStore, SingleRankNeedsNoNetwork) {
  LaunchEnv single;
  TcpStore store(single, 1s);
  std::array<uint8_t, 128> id = id_pattern();
  store.broadcast(id);
  store.barrier();
  EXPECT_EQ(id, id_pattern());
}

TEST(TcpStore, MissingRanksAreNamedOnEveryRankWithinTheTimeout) {
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::future<std::string>> ranks;
  for (int r : {0, 1, 3})  // of 5: ranks 2 and 4 never come
    ranks.push_back(start_rank([=] { TcpStore store(env_of(r, 5, port), 1s); }));
  const std::string rank0 = ranks[0].get();
  contains(rank0, "ranks 2, 4 did not connect within 1 s (3 of 5 ranks did)");
  for (size_t i = 1; i < ranks.size(); ++i) {
    const std::string peer = ranks[i].get();
    contains(peer, "rank 0 stopped the job");
    contains(peer, "ranks 2, 4 did not connect within 1 s");
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(TcpStore, APeerWithoutRankZeroTimesOut) {
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  auto rank1 = start_rank([=] { TcpStore store(env_of(1, 2, port), 500ms); });
  const std::string message = rank1.get();
  contains(message, "rank 1: rank 0 did not answer within 0.5 s");
  contains(message, std::to_string(port));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
}

TEST(TcpStore, AWrongWorldSizeIsRefusedOnBothSides) {
  const int port = free_port();
  auto rank0 = start_rank([=] { TcpStore store(env_of(0, 3, port), 5s); });
  auto rank1 = start_rank([=] { TcpStore store(env_of(1, 2, port), 5s); });
  const std::string why = "was started with world size 2, rank 0 with 3";
  const std::string m0 = rank0.get();
  const std::string m1 = rank1.get();
  contains(m0, why);
  contains(m1, "rank 0 stopped the job");
  contains(m1, why);
}

TEST(TcpStore, TwoProcessesClaimingOneRankAreRefused) {
  const int port = free_port();
  auto rank0 = start_rank([=] { TcpStore store(env_of(0, 3, port), 5s); });
  auto first = start_rank([=] { TcpStore store(env_of(1, 3, port), 5s); });
  auto second = start_rank([=] {
    std::this_thread::sleep_for(200ms);
    TcpStore store(env_of(1, 3, port), 5s);
  });
  contains(rank0.get(), "two processes say they are rank 1");
  contains(first.get(), "two processes say they are rank 1");
  contains(second.get(), "two processes say they are rank 1");
}

TEST(TcpStore, AnotherProtocolVersionIsRefused) {
  const int port = free_port();
  auto rank0 = start_rank([=] { TcpStore store(env_of(0, 2, port), 5s); });
  // A HELLO of version 2: magic "FRGR", version 2, type 1, 8 payload bytes (rank 1, world 2).
  const std::vector<uint8_t> hello{'F', 'R', 'G', 'R', 2, 0, 1, 0, 8, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0};
  net::Fd fd = net::connect_tcp("127.0.0.1", port, net::Clock::now() + 5s);
  net::send_all(fd, hello, net::Clock::now() + 1s, "rank 0");
  contains(rank0.get(), "speaks rendezvous protocol version 2, rank 0 speaks 1");
}

TEST(TcpStore, AStrangerOnThePortIsDroppedAndTheRendezvousGoesOn) {
  const int port = free_port();
  auto rank0 = start_rank([=] {
    TcpStore store(env_of(0, 2, port), 5s);
    store.barrier();
  });
  {
    net::Fd stranger = net::connect_tcp("127.0.0.1", port, net::Clock::now() + 5s);
    const std::string request = "GET / HTTP/1.0\r\n\r\n";
    net::send_all(stranger, {reinterpret_cast<const uint8_t*>(request.data()), request.size()}, net::Clock::now() + 1s,
                  "rank 0");
    std::this_thread::sleep_for(200ms);
  }
  auto rank1 = start_rank([=] {
    TcpStore store(env_of(1, 2, port), 5s);
    store.barrier();
  });
  EXPECT_EQ(rank0.get(), "");
  EXPECT_EQ(rank1.get(), "");
}

TEST(TcpStore, ABarrierNamesTheRankThatDoesNotArrive) {
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  std::promise<void> done;
  std::shared_future<void> finished = done.get_future().share();
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(start_rank([=] {
      TcpStore store(env_of(r, 3, port), 1s);
      if (r == 2) {
        finished.wait();  // stays connected, but never reaches the barrier
        return;
      }
      store.barrier();
    }));
  }
  contains(ranks[0].get(), "barrier: rank 2 did not arrive within 1 s (2 of 3 ranks did)");
  const std::string rank1 = ranks[1].get();
  contains(rank1, "rank 0 stopped the job");
  contains(rank1, "rank 2 did not arrive");
  done.set_value();
  EXPECT_EQ(ranks[2].get(), "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(TcpStore, ARankThatDiesEndsTheBarrierAtOnce) {
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < 3; ++r) {
    ranks.push_back(start_rank([=] {
      TcpStore store(env_of(r, 3, port), 30s);
      if (r == 2) return;  // its connection closes, as when its process exits
      store.barrier();
    }));
  }
  contains(ranks[0].get(), "barrier: rank 2 (");
  contains(ranks[1].get(), "closed its connection");
  EXPECT_EQ(ranks[2].get(), "");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST(TcpStore, RankZeroDyingEndsEveryWait) {
  const int port = free_port();
  auto rank0 = start_rank([=] { TcpStore store(env_of(0, 2, port), 30s); });
  auto rank1 = start_rank([=] {
    TcpStore store(env_of(1, 2, port), 30s);
    store.barrier();
  });
  EXPECT_EQ(rank0.get(), "");
  contains(rank1.get(), "rank 1: barrier: rank 0 at localhost:" + std::to_string(port) + " closed the connection");
}

TEST(TcpStore, BroadcastSizesMustAgree) {
  const int port = free_port();
  auto rank0 = start_rank([=] {
    TcpStore store(env_of(0, 2, port), 5s);
    std::array<uint8_t, 128> id = id_pattern();
    store.broadcast(id);
  });
  auto rank1 = start_rank([=] {
    TcpStore store(env_of(1, 2, port), 5s);
    std::array<uint8_t, 64> id{};
    store.broadcast(id);
  });
  EXPECT_EQ(rank0.get(), "");
  contains(rank1.get(), "rank 0 sent 128 bytes, this rank expected 64");
}

// Bytes that differ with the rank and the position, so a misplaced frame shows.
std::vector<uint8_t> pattern_of(int rank, size_t n) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<uint8_t>(i * 131 + i / 4099 + rank * 17);
  return out;
}

TEST(TcpStore, MessagesOfManyFramesGoToRankZeroAndBack) {
  const int port = free_port();
  const int world = 3;
  const size_t up = (size_t{3} << 20) + 5;  // 3 MiB and a bit: four frames after the head
  std::vector<std::future<std::string>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(start_rank([=] {
      TcpStore store(env_of(r, world, port), 10s);
      const std::vector<uint8_t> head{uint8_t(r), 1, 2};
      if (r == 0) {
        std::vector<std::vector<uint8_t>> got = store.gather_at_root(5s, "test");
        if (!got[0].empty()) throw Error("rank 0's own entry is not empty");
        for (int q = 1; q < world; ++q) {
          std::vector<uint8_t> expected = head;
          expected[0] = uint8_t(q);
          const std::vector<uint8_t> body = pattern_of(q, up);
          expected.insert(expected.end(), body.begin(), body.end());
          if (got[q] != expected) throw Error(fmt::format("rank {}'s message arrived changed", q));
          store.send_to(q, pattern_of(q + 10, up * q), 5s, "test");
        }
        store.send_to(1, {}, 5s, "test");
        return;
      }
      store.send_to_root(head, pattern_of(r, up), 5s, "test");
      if (r == 1) {
        std::vector<uint8_t> answer(up);
        store.receive_from_root(answer, 5s, "test");
        if (answer != pattern_of(r + 10, up)) throw Error("rank 1's answer arrived changed");
        if (!store.receive_from_root(5s, "test").empty()) throw Error("rank 1's empty answer is not empty");
      } else if (store.receive_from_root(5s, "test") != pattern_of(r + 10, up * r)) {
        throw Error(fmt::format("rank {}'s answer arrived changed", r));
      }
    }));
  }
  for (auto& rank : ranks) EXPECT_EQ(rank.get(), "");
}

TEST(TcpStore, AMessageOfAnotherSizeIsRefused) {
  const int port = free_port();
  auto rank0 = start_rank([=] {
    TcpStore store(env_of(0, 2, port), 5s);
    store.send_to(1, pattern_of(0, 10), 5s, "test");
  });
  auto rank1 = start_rank([=] {
    TcpStore store(env_of(1, 2, port), 5s);
    std::vector<uint8_t> data(8);
    store.receive_from_root(data, 5s, "all_gather #4");
  });
  // Rank 1 refuses the message on its first frame and closes; rank 0 is done, or still
  // writing the rest and told that rank 1 did not take it (which comes first is timing).
  const std::string sender = rank0.get();
  if (!sender.empty()) contains(sender, "rank 1 (");
  if (!sender.empty()) contains(sender, "did not take its result");
  contains(rank1.get(), "all_gather #4: rank 0 at localhost:" + std::to_string(port) +
                            " sent a message of 10 bytes where 8 were expected");
}

TEST(TcpStore, ARankStuckSendingHearsRankZerosVerdict) {
  const int port = free_port();
  const auto start = std::chrono::steady_clock::now();
  std::promise<void> done;
  std::shared_future<void> finished = done.get_future().share();
  auto rank0 = start_rank([=] {
    TcpStore store(env_of(0, 2, port), 30s);
    std::this_thread::sleep_for(300ms);  // rank 1's message fills the connection meanwhile
    try {
      store.abort("rank 2 is on fire");
    } catch (const Error&) {
      finished.wait();  // keeps the connection open: the verdict, not a reset, ends rank 1's wait
      throw;
    }
  });
  auto rank1 = start_rank([=] {
    TcpStore store(env_of(1, 2, port), 30s);
    store.send_to_root({}, pattern_of(1, size_t{64} << 20), 30s, "all_reduce #1");
  });
  const std::string message = rank1.get();
  done.set_value();
  EXPECT_EQ(message, "rank 0 stopped the job: rank 2 is on fire");
  EXPECT_EQ(rank0.get(), "rank 2 is on fire");
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
}

TEST(TcpStore, APortInUseIsNamed) {
  net::Fd holder = net::listen_tcp(0);
  const int port = net::bound_port(holder);
  try {
    TcpStore store(env_of(0, 2, port), 1s);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    contains(e.what(), "cannot listen on TCP port " + std::to_string(port));
    contains(e.what(), "MASTER_PORT");
  }
}

TEST(TcpStore, RanksFormatCompactly) {
  EXPECT_EQ(format_ranks(std::vector<int>{1, 2, 3, 7, 9, 10}), "1-3, 7, 9-10");
  EXPECT_EQ(format_ranks(std::vector<int>{4}), "4");
  EXPECT_EQ(format_ranks(std::vector<int>{}), "");
}

}  // namespace
}  // namespace forge
