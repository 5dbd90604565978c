#include "dist/tcp_store.h"

#include <fmt/format.h>
#include <poll.h>

#include <optional>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "dist/tcp_socket.h"

namespace forge {
namespace {

using net::Clock;
using net::Deadline;

// Frame layout (NOTE [TCP rendezvous]), little-endian: magic u32, version u16, type u16,
// payload length u32, payload. The layout of the header and of ABORT never changes, so a
// rank of another version can still read why it was refused.
constexpr uint32_t kMagic = 0x52475246;  // the bytes "FRGR"
constexpr uint16_t kVersion = 1;
constexpr size_t kHeaderBytes = 12;
constexpr uint32_t kMaxPayload = 1 << 20;
// Telling the other ranks why the rendezvous failed is best effort and must not itself
// hold up the failing rank.
constexpr auto kAbortSendTimeout = std::chrono::seconds(1);
// A rank waiting for rank 0 waits this much longer than rank 0 waits for the others (at
// most the timeout itself), so that when both started waiting at about the same time,
// rank 0's verdict, which names the ranks it misses, arrives before the waiting rank's
// own deadline passes.
constexpr std::chrono::milliseconds kVerdictGrace = std::chrono::seconds(5);

enum class FrameType : uint16_t { Hello = 1, Welcome = 2, Abort = 3, Data = 4, Arrive = 5, Release = 6 };

struct Frame {
  FrameType type;
  std::vector<uint8_t> payload;
};

void put_u32(std::vector<uint8_t>& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u16(std::vector<uint8_t>& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
uint32_t get_u32(const uint8_t* p) {
  return uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24;
}
uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | p[1] << 8); }

std::vector<uint8_t> encode(FrameType type, std::span<const uint8_t> payload) {
  std::vector<uint8_t> out;
  put_u32(out, kMagic);
  put_u16(out, kVersion);
  put_u16(out, static_cast<uint16_t>(type));
  put_u32(out, static_cast<uint32_t>(payload.size()));
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::span<const uint8_t> text_bytes(const std::string& text) {
  return {reinterpret_cast<const uint8_t*>(text.data()), text.size()};
}

std::string seconds_text(std::chrono::milliseconds ms) { return fmt::format("{:g} s", ms.count() / 1000.0); }

struct Connection {
  net::Fd fd;
  std::vector<uint8_t> buffer;
  std::string address;
  bool closed = false;  // the other side closed; what is in `buffer` is all there will be
};

enum class Parsed { Incomplete, Frame, NotForge, OtherVersion };

// Takes one complete frame off the front of c.buffer.
Parsed take_frame(Connection& c, Frame& frame, uint16_t& version) {
  const uint8_t* p = c.buffer.data();
  if (c.buffer.size() >= 4 && get_u32(p) != kMagic) return Parsed::NotForge;
  if (c.buffer.size() < kHeaderBytes) return Parsed::Incomplete;
  version = get_u16(p + 4);
  const auto type = static_cast<FrameType>(get_u16(p + 6));
  const uint32_t length = get_u32(p + 8);
  if (version != kVersion && type != FrameType::Abort) return Parsed::OtherVersion;
  if (length > kMaxPayload) return Parsed::NotForge;
  if (c.buffer.size() < kHeaderBytes + length) return Parsed::Incomplete;
  frame.type = type;
  frame.payload.assign(c.buffer.begin() + kHeaderBytes, c.buffer.begin() + kHeaderBytes + length);
  c.buffer.erase(c.buffer.begin(), c.buffer.begin() + kHeaderBytes + length);
  return Parsed::Frame;
}

void send_frame(Connection& c, FrameType type, std::span<const uint8_t> payload, Deadline deadline,
                std::string_view what) {
  net::send_all(c.fd, encode(type, payload), deadline, what);
}

void send_abort_quietly(Connection& c, const std::string& reason) {
  if (!c.fd.valid() || c.closed) return;
  try {
    send_frame(c, FrameType::Abort, text_bytes(reason), Clock::now() + kAbortSendTimeout, c.address);
  } catch (const Error&) {
    // That rank is gone already; it needs no explanation.
  }
}

// Reads what `c` has for us; marks it closed at end of stream.
void pump(Connection& c) {
  if (!c.closed && !net::read_available(c.fd, c.buffer)) c.closed = true;
}

std::vector<uint8_t> hello_payload(int rank, int world_size) {
  std::vector<uint8_t> out;
  put_u32(out, static_cast<uint32_t>(rank));
  put_u32(out, static_cast<uint32_t>(world_size));
  return out;
}

}  // namespace

std::string format_ranks(std::span<const int> ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += j == i ? fmt::format("{}", ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]);
    i = j + 1;
  }
  return out;
}

// Rank 0 holds the listener and one connection per other rank (index = rank, [0] unused);
// every other rank holds one connection, to rank 0, at index 0.
struct TcpStore::Peers {
  net::Fd listener;
  std::vector<Connection> ranks;
  std::string where;  // "MASTER_ADDR:MASTER_PORT" for messages
  bool failed = false;

  // Rank 0: tells every connected rank why the job stops, then throws it.
  [[noreturn]] void fail_all(const std::string& reason) {
    failed = true;
    for (Connection& c : ranks) send_abort_quietly(c, reason);
    throw Error(reason);
  }

  // Rank 0: waits until every rank has sent a frame of `type`, failing on timeout, a
  // closed connection or a protocol error. `stage` names the wait in messages.
  void gather(FrameType type, std::chrono::milliseconds timeout, const char* stage) {
    const Deadline deadline = Clock::now() + timeout;
    const int world = static_cast<int>(ranks.size());
    std::vector<bool> arrived(world, false);
    arrived[0] = true;
    int count = 1;
    while (count < world) {
      std::vector<pollfd> fds;
      std::vector<int> fd_rank;
      for (int r = 1; r < world; ++r) {
        if (arrived[r]) continue;
        fds.push_back({ranks[r].fd.get(), POLLIN, 0});
        fd_rank.push_back(r);
      }
      if (poll(fds.data(), fds.size(), net::milliseconds_until(deadline)) == 0 || Clock::now() >= deadline) {
        std::vector<int> missing;
        for (int r = 1; r < world; ++r)
          if (!arrived[r]) missing.push_back(r);
        fail_all(fmt::format("{}: rank{} {} did not arrive within {} ({} of {} ranks did)", stage,
                             missing.size() > 1 ? "s" : "", format_ranks(missing), seconds_text(timeout), count,
                             world));
      }
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const int r = fd_rank[i];
        Connection& c = ranks[r];
        pump(c);
        Frame frame;
        uint16_t version = 0;
        const Parsed parsed = take_frame(c, frame, version);
        if (parsed == Parsed::Frame && frame.type == type && frame.payload.empty()) {
          arrived[r] = true;
          ++count;
        } else if (parsed != Parsed::Incomplete) {
          fail_all(fmt::format("{}: rank {} ({}) sent an unexpected message", stage, r, c.address));
        } else if (c.closed) {
          fail_all(fmt::format("{}: rank {} ({}) closed its connection (its process exited?)", stage, r, c.address));
        }
      }
    }
  }

  // Rank 0: accepts connections until every rank has introduced itself.
  void accept_all(int world_size, std::chrono::milliseconds timeout) {
    const Deadline deadline = Clock::now() + timeout;
    ranks.resize(world_size);
    std::vector<Connection> pending;
    int count = 1;
    while (count < world_size) {
      std::vector<pollfd> fds{{listener.get(), POLLIN, 0}};
      for (const Connection& c : pending) fds.push_back({c.fd.get(), POLLIN, 0});
      for (int r = 1; r < world_size; ++r)
        if (ranks[r].fd.valid()) fds.push_back({ranks[r].fd.get(), POLLIN, 0});
      if (poll(fds.data(), fds.size(), net::milliseconds_until(deadline)) == 0 || Clock::now() >= deadline) {
        std::vector<int> missing;
        for (int r = 1; r < world_size; ++r)
          if (!ranks[r].fd.valid()) missing.push_back(r);
        fail_all(fmt::format("rendezvous on {}: rank{} {} did not connect within {} ({} of {} ranks did)", where,
                             missing.size() > 1 ? "s" : "", format_ranks(missing), seconds_text(timeout), count,
                             world_size));
      }
      // A rank that already said hello has nothing more to say until WELCOME; if its
      // connection became readable, it closed.
      for (int r = 1; r < world_size; ++r) {
        if (!ranks[r].fd.valid()) continue;
        pump(ranks[r]);
        if (ranks[r].closed)
          fail_all(
              fmt::format("rendezvous on {}: rank {} ({}) disconnected before every rank had arrived "
                          "(its process exited?)",
                          where, r, ranks[r].address));
      }
      for (size_t i = 0; i < pending.size();) {
        if (introduce(pending[i], world_size, count)) {
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
      while (true) {
        Connection c;
        c.fd = net::accept_tcp(listener, c.address);
        if (!c.fd.valid()) break;
        pending.push_back(std::move(c));
      }
    }
  }

  // Reads a pending connection's HELLO. True when the connection is settled (it joined as
  // its rank, or was dropped); false while its HELLO is incomplete.
  bool introduce(Connection& c, int world_size, int& count) {
    pump(c);
    Frame frame;
    uint16_t version = 0;
    switch (take_frame(c, frame, version)) {
      case Parsed::Incomplete:
        if (!c.closed) return false;
        log_warn("rendezvous on {}: {} connected and closed without introducing itself", where, c.address);
        return true;
      case Parsed::NotForge:
        log_warn("rendezvous on {}: dropped a connection from {} that does not speak forge's rendezvous protocol",
                 where, c.address);
        return true;
      case Parsed::OtherVersion: {
        const std::string reason = fmt::format(
            "rendezvous on {}: a rank at {} speaks rendezvous protocol version {}, rank 0 speaks {} "
            "(every rank must run the same forge build)",
            where, c.address, version, kVersion);
        send_abort_quietly(c, reason);
        fail_all(reason);
      }
      case Parsed::Frame:
        break;
    }
    if (frame.type != FrameType::Hello || frame.payload.size() != 8) {
      log_warn("rendezvous on {}: dropped a connection from {} that did not open with HELLO", where, c.address);
      return true;
    }
    const int rank = static_cast<int>(get_u32(frame.payload.data()));
    const int their_world = static_cast<int>(get_u32(frame.payload.data() + 4));
    std::string reason;
    if (their_world != world_size) {
      reason = fmt::format(
          "rendezvous on {}: rank {} at {} was started with world size {}, rank 0 with {} "
          "(every rank must be started with the same WORLD_SIZE; another job on this port?)",
          where, rank, c.address, their_world, world_size);
    } else if (rank < 1 || rank >= world_size) {
      reason = fmt::format("rendezvous on {}: a process at {} says it is rank {}, outside 1..{}", where, c.address,
                           rank, world_size - 1);
    } else if (ranks[rank].fd.valid()) {
      reason = fmt::format("rendezvous on {}: two processes say they are rank {}: {} and {}", where, rank,
                           ranks[rank].address, c.address);
    }
    if (!reason.empty()) {
      send_abort_quietly(c, reason);
      fail_all(reason);
    }
    ranks[rank] = std::move(c);
    ++count;
    return true;
  }

  // Any other rank: the next frame from rank 0, which must be `expected` (or ABORT).
  Frame receive(FrameType expected, std::chrono::milliseconds timeout, int my_rank, const char* stage) {
    Connection& c = ranks[0];
    const std::chrono::milliseconds wait = timeout + std::min(timeout, kVerdictGrace);
    const Deadline deadline = Clock::now() + wait;
    while (true) {
      Frame frame;
      uint16_t version = 0;
      switch (take_frame(c, frame, version)) {
        case Parsed::Frame:
          if (frame.type == FrameType::Abort) {
            failed = true;
            FORGE_FAIL("rank {}: rank 0 stopped the job: {}", my_rank,
                       std::string(frame.payload.begin(), frame.payload.end()));
          }
          if (frame.type != expected)
            FORGE_FAIL("rank {}: {}: rank 0 at {} sent an unexpected message", my_rank, stage, where);
          return frame;
        case Parsed::NotForge:
          FORGE_FAIL(
              "rank {}: {} answered with something that is not forge's rendezvous (another service on "
              "MASTER_PORT?)",
              my_rank, where);
        case Parsed::OtherVersion:
          FORGE_FAIL(
              "rank {}: rank 0 at {} speaks rendezvous protocol version {}, this rank {} (every rank must "
              "run the same forge build)",
              my_rank, where, version, kVersion);
        case Parsed::Incomplete:
          break;
      }
      if (c.closed)
        FORGE_FAIL("rank {}: {}: rank 0 at {} closed the connection (rank 0 failed or exited; its log says why)",
                   my_rank, stage, where);
      pollfd p{c.fd.get(), POLLIN, 0};
      if (poll(&p, 1, net::milliseconds_until(deadline)) == 0 || Clock::now() >= deadline)
        FORGE_FAIL(
            "rank {}: {}: no word from rank 0 at {} within {} (rank 0, or a rank it waits for, is stuck or "
            "missing)",
            my_rank, stage, where, seconds_text(wait));
      pump(c);
    }
  }
};

TcpStore::TcpStore(const LaunchEnv& env, std::chrono::milliseconds timeout)
    : rank_(env.rank), world_size_(env.world_size), timeout_(timeout), peers_(std::make_unique<Peers>()) {
  FORGE_CHECK(env.rank >= 0 && env.rank < env.world_size, "rank {} outside world size {}", env.rank, env.world_size);
  if (world_size_ == 1) return;
  peers_->where = fmt::format("{}:{}", env.master_addr, env.master_port);
  if (rank_ == 0) {
    peers_->listener = net::listen_tcp(env.master_port);
    peers_->accept_all(world_size_, timeout_);
    const Deadline deadline = Clock::now() + timeout_;
    for (int r = 1; r < world_size_; ++r)
      send_frame(peers_->ranks[r], FrameType::Welcome, {}, deadline, fmt::format("rank {}", r));
    return;
  }
  peers_->ranks.resize(1);
  Connection& c = peers_->ranks[0];
  try {
    c.fd = net::connect_tcp(env.master_addr, env.master_port, Clock::now() + timeout_);
  } catch (const Error& e) {
    FORGE_FAIL(
        "rank {}: rank 0 did not answer within {}: {} (is rank 0 running, and do all ranks have the same "
        "MASTER_ADDR and MASTER_PORT?)",
        rank_, seconds_text(timeout_), e.what());
  }
  c.address = peers_->where;
  send_frame(c, FrameType::Hello, hello_payload(rank_, world_size_), Clock::now() + timeout_, "rank 0");
  peers_->receive(FrameType::Welcome, timeout_, rank_, "rendezvous");
}

TcpStore::~TcpStore() = default;

void TcpStore::broadcast(std::span<uint8_t> data) {
  FORGE_CHECK(!peers_->failed, "the rendezvous failed earlier");
  if (world_size_ == 1) return;
  if (rank_ == 0) {
    const Deadline deadline = Clock::now() + timeout_;
    for (int r = 1; r < world_size_; ++r)
      send_frame(peers_->ranks[r], FrameType::Data, data, deadline, fmt::format("rank {}", r));
    return;
  }
  const Frame frame = peers_->receive(FrameType::Data, timeout_, rank_, "broadcast");
  if (frame.payload.size() != data.size())
    FORGE_FAIL("rank {}: broadcast: rank 0 sent {} bytes, this rank expected {}", rank_, frame.payload.size(),
               data.size());
  std::copy(frame.payload.begin(), frame.payload.end(), data.begin());
}

void TcpStore::barrier() {
  FORGE_CHECK(!peers_->failed, "the rendezvous failed earlier");
  if (world_size_ == 1) return;
  if (rank_ == 0) {
    peers_->gather(FrameType::Arrive, timeout_, "barrier");
    const Deadline deadline = Clock::now() + timeout_;
    for (int r = 1; r < world_size_; ++r)
      send_frame(peers_->ranks[r], FrameType::Release, {}, deadline, fmt::format("rank {}", r));
    return;
  }
  send_frame(peers_->ranks[0], FrameType::Arrive, {}, Clock::now() + timeout_, "rank 0");
  peers_->receive(FrameType::Release, timeout_, rank_, "barrier");
}

}  // namespace forge
