#include "distributed/tcp_store.h"

#include <fmt/format.h>
#include <poll.h>

#include <algorithm>
#include <functional>
#include <initializer_list>
#include <optional>
#include <vector>

#include "core/error.h"
#include "core/log.h"
#include "distributed/tcp_socket.h"

namespace forge {
namespace {

using net::Clock;
using net::Deadline;
using net::seconds_text;

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

// Message and Part carry the messages of any length of the CPU process group: a Message
// frame holds the length (u64), Part frames the bytes (NOTE [TCP messages]).
enum class FrameType : uint16_t {
  Hello = 1,
  Welcome = 2,
  Abort = 3,
  Data = 4,
  Arrive = 5,
  Release = 6,
  Message = 7,
  Part = 8
};

struct Frame {
  FrameType type;
  std::vector<uint8_t> payload;
};

// A frame still in the connection's buffer.
struct FrameView {
  FrameType type;
  std::span<const uint8_t> payload;
};

void put_u32(std::vector<uint8_t>& out, uint32_t v) { net::put_le(out, v, 4); }
void put_u16(std::vector<uint8_t>& out, uint16_t v) { net::put_le(out, v, 2); }
void put_u64(std::vector<uint8_t>& out, uint64_t v) { net::put_le(out, v, 8); }
uint32_t get_u32(const uint8_t* p) { return static_cast<uint32_t>(net::get_le(p, 4)); }
uint16_t get_u16(const uint8_t* p) { return static_cast<uint16_t>(net::get_le(p, 2)); }
uint64_t get_u64(const uint8_t* p) { return net::get_le(p, 8); }

std::vector<uint8_t> frame_header(FrameType type, size_t payload_bytes) {
  std::vector<uint8_t> out;
  put_u32(out, kMagic);
  put_u16(out, kVersion);
  put_u16(out, static_cast<uint16_t>(type));
  put_u32(out, static_cast<uint32_t>(payload_bytes));
  return out;
}

std::vector<uint8_t> encode(FrameType type, std::span<const uint8_t> payload) {
  std::vector<uint8_t> out = frame_header(type, payload.size());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::span<const uint8_t> text_bytes(const std::string& text) {
  return {reinterpret_cast<const uint8_t*>(text.data()), text.size()};
}


struct Connection {
  net::Fd fd;
  std::vector<uint8_t> buffer;  // bytes received; those before `start` are taken already
  size_t start = 0;
  std::string address;
  bool closed = false;  // the other side closed; what is in `buffer` is all there will be
};

enum class Parsed { Incomplete, Frame, NotForge, OtherVersion };

// The complete frame at the front of what `c` received, left in place.
Parsed peek_frame(const Connection& c, FrameView& frame, uint16_t& version) {
  const uint8_t* p = c.buffer.data() + c.start;
  const size_t size = c.buffer.size() - c.start;
  if (size >= 4 && get_u32(p) != kMagic) return Parsed::NotForge;
  if (size < kHeaderBytes) return Parsed::Incomplete;
  version = get_u16(p + 4);
  const auto type = static_cast<FrameType>(get_u16(p + 6));
  const uint32_t length = get_u32(p + 8);
  if (version != kVersion && type != FrameType::Abort) return Parsed::OtherVersion;
  if (length > kMaxPayload) return Parsed::NotForge;
  if (size < kHeaderBytes + length) return Parsed::Incomplete;
  frame.type = type;
  frame.payload = {p + kHeaderBytes, length};
  return Parsed::Frame;
}

// Drops the frame peek_frame() returned. The buffer is emptied when everything in it was
// taken, else compacted once more than half of it was, so large messages cost linear time.
void drop_frame(Connection& c, const FrameView& frame) {
  c.start += kHeaderBytes + frame.payload.size();
  if (c.start == c.buffer.size()) {
    c.buffer.clear();
    c.start = 0;
  } else if (c.start > c.buffer.size() / 2) {
    c.buffer.erase(c.buffer.begin(), c.buffer.begin() + static_cast<std::ptrdiff_t>(c.start));
    c.start = 0;
  }
}

// Takes one complete frame off the front of what `c` received.
Parsed take_frame(Connection& c, Frame& frame, uint16_t& version) {
  FrameView view;
  const Parsed parsed = peek_frame(c, view, version);
  if (parsed != Parsed::Frame) return parsed;
  frame.type = view.type;
  frame.payload.assign(view.payload.begin(), view.payload.end());
  drop_frame(c, view);
  return parsed;
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

// Sends `parts`, concatenated, as one message (NOTE [TCP messages]) without copying them.
// `on_readable` as for net::send_all.
void send_message(Connection& c, std::initializer_list<std::span<const uint8_t>> parts, Deadline deadline,
                  std::string_view what, const std::function<void()>& on_readable = {}) {
  uint64_t length = 0;
  for (const auto& part : parts) length += part.size();
  std::vector<uint8_t> start;
  put_u64(start, length);
  net::send_all(c.fd, encode(FrameType::Message, start), deadline, what, on_readable);
  for (const auto& part : parts) {
    for (size_t offset = 0; offset < part.size(); offset += kMaxPayload) {
      const std::span<const uint8_t> piece = part.subspan(offset, std::min<size_t>(kMaxPayload, part.size() - offset));
      net::send_all(c.fd, frame_header(FrameType::Part, piece.size()), deadline, what, on_readable);
      net::send_all(c.fd, piece, deadline, what, on_readable);
    }
  }
}

// One message being received (NOTE [TCP messages]): into `into` when the receiver knows
// its size (`sized`), else into `owned`.
struct Inbound {
  std::vector<uint8_t> owned;
  std::span<uint8_t> into;
  bool sized = false;
  bool started = false;
  uint64_t length = 0;
  uint64_t received = 0;
  bool complete() const { return started && received == length; }
};

enum class Progress { Incomplete, Complete, Abort, Unexpected };

// Takes the frames of `in`'s message off what `c` received so far. Abort: `detail` is
// rank 0's reason; Unexpected: `detail` says what came instead of the message.
Progress take_message(Connection& c, Inbound& in, std::string& detail) {
  while (!in.complete()) {
    FrameView frame;
    uint16_t version = 0;
    switch (peek_frame(c, frame, version)) {
      case Parsed::Incomplete:
        return Progress::Incomplete;
      case Parsed::NotForge:
        detail = "bytes that are not forge's protocol";
        return Progress::Unexpected;
      case Parsed::OtherVersion:
        detail = fmt::format("a frame of protocol version {}", version);
        return Progress::Unexpected;
      case Parsed::Frame:
        break;
    }
    if (frame.type == FrameType::Abort) {
      detail.assign(frame.payload.begin(), frame.payload.end());
      drop_frame(c, frame);
      return Progress::Abort;
    }
    if (!in.started) {
      if (frame.type != FrameType::Message || frame.payload.size() != 8) {
        detail = "something other than the start of a message";
        return Progress::Unexpected;
      }
      in.length = get_u64(frame.payload.data());
      if (in.sized && in.length != in.into.size()) {
        detail = fmt::format("a message of {} bytes where {} were expected", in.length, in.into.size());
        return Progress::Unexpected;
      }
      // A message is at most a few tensors; the cap only keeps a corrupt length from
      // reserving absurd amounts before its bytes arrive.
      if (!in.sized) in.owned.reserve(std::min<uint64_t>(in.length, uint64_t{1} << 32));
      in.started = true;
    } else {
      if (frame.type != FrameType::Part || frame.payload.size() > in.length - in.received) {
        detail = "a frame that does not continue the message";
        return Progress::Unexpected;
      }
      if (in.sized) {
        std::copy(frame.payload.begin(), frame.payload.end(),
                  in.into.begin() + static_cast<std::ptrdiff_t>(in.received));
      } else {
        in.owned.insert(in.owned.end(), frame.payload.begin(), frame.payload.end());
      }
      in.received += frame.payload.size();
    }
    drop_frame(c, frame);
  }
  return Progress::Complete;
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
  std::vector<int> names;  // the number messages give each rank; empty: its rank
  bool failed = false;
  int culprit = -1;  // rank 0: the one rank a failed gather blamed

  int name(int r) const { return names.empty() || r < 0 || r >= static_cast<int>(names.size()) ? r : names[r]; }
  std::vector<int> named(std::vector<int> ranks) const {
    for (int& r : ranks) r = name(r);
    return ranks;
  }

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
                             missing.size() > 1 ? "s" : "", format_ranks(named(missing)), seconds_text(timeout), count,
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
          fail_all(fmt::format("{}: rank {} ({}) sent an unexpected message", stage, name(r), c.address));
        } else if (c.closed) {
          fail_all(
              fmt::format("{}: rank {} ({}) closed its connection (its process exited?)", stage, name(r), c.address));
        }
      }
    }
  }

  // Rank 0: one message from every other rank, failing as gather() does.
  std::vector<std::vector<uint8_t>> gather_messages(std::chrono::milliseconds timeout, std::string_view stage) {
    const Deadline deadline = Clock::now() + timeout;
    const int world = static_cast<int>(ranks.size());
    std::vector<Inbound> messages(world);
    int count = 1;
    // Takes what arrived from rank r; true when its message is complete.
    const auto take = [&](int r) {
      Connection& c = ranks[r];
      std::string detail;
      switch (take_message(c, messages[r], detail)) {
        case Progress::Complete:
          return true;
        case Progress::Incomplete:
          if (c.closed) {
            culprit = r;
            fail_all(fmt::format("{}: rank {} ({}) closed its connection (its process exited?)", stage, name(r),
                                 c.address));
          }
          return false;
        case Progress::Abort:
        case Progress::Unexpected:
          break;
      }
      fail_all(fmt::format("{}: rank {} ({}) sent an unexpected message", stage, name(r), c.address));
    };
    for (int r = 1; r < world; ++r)
      if (take(r)) ++count;
    while (count < world) {
      std::vector<pollfd> fds;
      std::vector<int> fd_rank;
      for (int r = 1; r < world; ++r) {
        if (messages[r].complete()) continue;
        fds.push_back({ranks[r].fd.get(), POLLIN, 0});
        fd_rank.push_back(r);
      }
      if (poll(fds.data(), fds.size(), net::milliseconds_until(deadline)) == 0 || Clock::now() >= deadline) {
        std::vector<int> missing;
        for (int r = 1; r < world; ++r)
          if (!messages[r].complete()) missing.push_back(r);
        if (missing.size() == 1) culprit = missing[0];
        fail_all(fmt::format("{}: rank{} {} did not arrive within {} ({} of {} ranks did)", stage,
                             missing.size() > 1 ? "s" : "", format_ranks(named(missing)), seconds_text(timeout), count,
                             world));
      }
      for (size_t i = 0; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        pump(ranks[fd_rank[i]]);
        if (take(fd_rank[i])) ++count;
      }
    }
    std::vector<std::vector<uint8_t>> out(world);
    for (int r = 1; r < world; ++r) out[r] = std::move(messages[r].owned);
    return out;
  }

  // Rank 0: sends `data` to rank `r` as one message; a rank that cannot take it fails the job.
  void send_to(int r, std::span<const uint8_t> data, std::chrono::milliseconds timeout, std::string_view stage) {
    Connection& c = ranks[r];
    try {
      send_message(c, {data}, Clock::now() + timeout, fmt::format("rank {}", name(r)));
    } catch (const Error& e) {
      fail_all(fmt::format("{}: rank {} ({}) did not take its result: {} (its process exited, or hangs?)", stage,
                           name(r), c.address, e.what()));
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
                             missing.size() > 1 ? "s" : "", format_ranks(named(missing)), seconds_text(timeout),
                             count, world_size));
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
                          where, name(r), ranks[r].address));
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
      reason = fmt::format("rendezvous on {}: two processes say they are rank {}: {} and {}", where, name(rank),
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

  // Any other rank: reads from rank 0 until `take` (which looks at what arrived so far, and
  // throws what is wrong with it) returns true, failing when rank 0 closes the connection
  // or `deadline` passes. Messages start with `prefix`.
  template <typename Take>
  void await_root(Take&& take, Deadline deadline, std::chrono::milliseconds wait, std::string_view prefix,
                  std::string_view stage) {
    Connection& c = ranks[0];
    while (true) {
      if (take(c)) return;
      if (c.closed)
        FORGE_FAIL("{}{}: rank {} at {} closed the connection (rank {} failed or exited; its log says why)", prefix,
                   stage, name(0), where, name(0));
      pollfd p{c.fd.get(), POLLIN, 0};
      if (poll(&p, 1, net::milliseconds_until(deadline)) == 0 || Clock::now() >= deadline)
        FORGE_FAIL(
            "{}{}: no word from rank {} at {} within {} (rank {}, or a rank it waits for, is stuck or "
            "missing)",
            prefix, stage, name(0), where, seconds_text(wait), name(0));
      pump(c);
    }
  }

  // Any other rank: the next frame from rank 0, which must be `expected` (or ABORT).
  Frame receive(FrameType expected, std::chrono::milliseconds timeout, int my_rank, const char* stage) {
    const std::chrono::milliseconds wait = timeout + std::min(timeout, kVerdictGrace);
    Frame frame;
    await_root(
        [&](Connection& c) {
          uint16_t version = 0;
          switch (take_frame(c, frame, version)) {
            case Parsed::Frame:
              if (frame.type == FrameType::Abort) {
                failed = true;
                FORGE_FAIL("rank {}: rank {} stopped the job: {}", name(my_rank), name(0),
                           std::string(frame.payload.begin(), frame.payload.end()));
              }
              if (frame.type != expected)
                FORGE_FAIL("rank {}: {}: rank {} at {} sent an unexpected message", name(my_rank), stage, name(0),
                           where);
              return true;
            case Parsed::NotForge:
              FORGE_FAIL(
                  "rank {}: {} answered with something that is not forge's rendezvous (another service on "
                  "MASTER_PORT?)",
                  name(my_rank), where);
            case Parsed::OtherVersion:
              FORGE_FAIL(
                  "rank {}: rank {} at {} speaks rendezvous protocol version {}, this rank {} (every rank must "
                  "run the same forge build)",
                  name(my_rank), name(0), where, version, kVersion);
            case Parsed::Incomplete:
              break;
          }
          return false;
        },
        Clock::now() + wait, wait, fmt::format("rank {}: ", name(my_rank)), stage);
    return frame;
  }

  // Any other rank: rank 0's next message, into `in`.
  void receive_message(Inbound& in, std::chrono::milliseconds timeout, std::string_view stage) {
    const std::chrono::milliseconds wait = timeout + std::min(timeout, kVerdictGrace);
    await_root([&](Connection& c) { return took_from_root(c, in, stage); }, Clock::now() + wait, wait, "", stage);
  }

  // Any other rank: true once `in` is complete; throws rank 0's verdict when it sent one.
  bool took_from_root(Connection& c, Inbound& in, std::string_view stage) {
    std::string detail;
    switch (take_message(c, in, detail)) {
      case Progress::Complete:
        return true;
      case Progress::Incomplete:
        return false;
      case Progress::Abort:
        failed = true;
        FORGE_FAIL("rank {} stopped the job: {}", name(0), detail);
      case Progress::Unexpected:
        failed = true;
        FORGE_FAIL("{}: rank {} at {} sent {}", stage, name(0), where, detail);
    }
    return false;
  }

  // Any other rank: sends a message to rank 0. Rank 0 reads it only once it has reached
  // the same call, and may instead stop the job; so while the message does not fit into
  // the connection, what rank 0 sends is read, and its verdict ends the wait.
  void send_to_root(std::initializer_list<std::span<const uint8_t>> parts, std::chrono::milliseconds timeout,
                    std::string_view stage) {
    Connection& c = ranks[0];
    const std::chrono::milliseconds wait = timeout + std::min(timeout, kVerdictGrace);
    // Nothing but a verdict can come from rank 0 before it has this message.
    Inbound nothing;
    nothing.sized = true;
    const auto check_verdict = [&] {
      pump(c);
      if (took_from_root(c, nothing, stage))
        FORGE_FAIL("{}: rank {} at {} sent a message before it had this rank's", stage, name(0), where);
      if (c.closed)
        FORGE_FAIL("{}: rank {} at {} closed the connection (rank {} failed or exited; its log says why)", stage,
                   name(0), where, name(0));
    };
    try {
      send_message(c, parts, Clock::now() + wait, fmt::format("rank {}", name(0)), check_verdict);
    } catch (const Error& e) {
      if (failed) throw;
      // The connection broke or the deadline passed: rank 0 may have said why before.
      check_verdict();
      FORGE_FAIL("{}: {} (rank {}, or a rank it waits for, is stuck or missing)", stage, e.what(), name(0));
    }
  }
};

TcpStore::TcpStore(const LaunchEnv& env, std::chrono::milliseconds timeout)
    : rank_(env.rank),
      world_size_(env.world_size),
      timeout_(timeout),
      host_(env.master_addr),
      peers_(std::make_unique<Peers>()) {
  FORGE_CHECK(env.rank >= 0 && env.rank < env.world_size, "rank {} outside world size {}", env.rank, env.world_size);
  if (world_size_ == 1) return;
  meet(rank_ == 0 ? net::listen_tcp(env.master_port) : net::Fd(), env.master_port);
}

TcpStore::TcpStore(int rank, int world_size, net::Fd listener, const std::string& host, int port,
                   std::vector<int> names, std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), timeout_(timeout), host_(host), peers_(std::make_unique<Peers>()) {
  FORGE_CHECK(rank >= 0 && rank < world_size, "rank {} outside world size {}", rank, world_size);
  FORGE_CHECK(names.empty() || names.size() == static_cast<size_t>(world_size), "{} rank names for {} ranks",
              names.size(), world_size);
  peers_->names = std::move(names);
  if (world_size_ == 1) return;
  FORGE_CHECK(rank != 0 || listener.valid(), "rank 0 of a TcpStore without a listening socket");
  meet(std::move(listener), port);
}

// The rendezvous (NOTE [TCP rendezvous]): rank 0 accepts everyone on `listener` and
// welcomes them, the others connect to host_:port.
void TcpStore::meet(net::Fd listener, int port) {
  peers_->where = fmt::format("{}:{}", host_, port);
  if (rank_ == 0) {
    peers_->listener = std::move(listener);
    peers_->accept_all(world_size_, timeout_);
    const Deadline deadline = Clock::now() + timeout_;
    for (int r = 1; r < world_size_; ++r)
      send_frame(peers_->ranks[r], FrameType::Welcome, {}, deadline, fmt::format("rank {}", peers_->name(r)));
    return;
  }
  peers_->ranks.resize(1);
  Connection& c = peers_->ranks[0];
  try {
    c.fd = net::connect_tcp(host_, port, Clock::now() + timeout_);
  } catch (const Error& e) {
    FORGE_FAIL(
        "rank {}: rank {} did not answer within {}: {} (is rank {} running, and do all ranks have the same "
        "MASTER_ADDR and MASTER_PORT?)",
        peers_->name(rank_), peers_->name(0), seconds_text(timeout_), e.what(), peers_->name(0));
  }
  c.address = peers_->where;
  send_frame(c, FrameType::Hello, hello_payload(rank_, world_size_), Clock::now() + timeout_,
             fmt::format("rank {}", peers_->name(0)));
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

void TcpStore::send_to_root(std::span<const uint8_t> head, std::span<const uint8_t> body,
                            std::chrono::milliseconds timeout, std::string_view stage) {
  FORGE_CHECK(!peers_->failed, "the rendezvous failed earlier");
  FORGE_CHECK(rank_ != 0, "send_to_root on rank 0");
  peers_->send_to_root({head, body}, timeout, stage);
}

std::vector<uint8_t> TcpStore::receive_from_root(std::chrono::milliseconds timeout, std::string_view stage) {
  FORGE_CHECK(!peers_->failed, "the rendezvous failed earlier");
  FORGE_CHECK(rank_ != 0, "receive_from_root on rank 0");
  Inbound in;
  peers_->receive_message(in, timeout, stage);
  return std::move(in.owned);
}

void TcpStore::receive_from_root(std::span<uint8_t> data, std::chrono::milliseconds timeout, std::string_view stage) {
  FORGE_CHECK(!peers_->failed, "the rendezvous failed earlier");
  FORGE_CHECK(rank_ != 0, "receive_from_root on rank 0");
  Inbound in;
  in.into = data;
  in.sized = true;
  peers_->receive_message(in, timeout, stage);
}

std::vector<std::vector<uint8_t>> TcpStore::gather_at_root(std::chrono::milliseconds timeout, std::string_view stage) {
  FORGE_CHECK(!peers_->failed, "the rendezvous failed earlier");
  FORGE_CHECK(rank_ == 0, "gather_at_root on rank {}", rank_);
  if (world_size_ == 1) return std::vector<std::vector<uint8_t>>(1);
  return peers_->gather_messages(timeout, stage);
}

void TcpStore::send_to(int rank, std::span<const uint8_t> data, std::chrono::milliseconds timeout,
                       std::string_view stage) {
  FORGE_CHECK(!peers_->failed, "the rendezvous failed earlier");
  FORGE_CHECK(rank_ == 0 && rank > 0 && rank < world_size_, "send_to rank {} from rank {}", rank, rank_);
  peers_->send_to(rank, data, timeout, stage);
}

void TcpStore::abort(const std::string& reason) {
  FORGE_CHECK(rank_ == 0, "abort on rank {}", rank_);
  if (peers_->failed || world_size_ == 1) throw Error(reason);
  peers_->fail_all(reason);
}

int TcpStore::culprit() const { return peers_->culprit; }

std::string TcpStore::peer_host(int rank) const {
  FORGE_CHECK(rank_ == 0 && rank > 0 && rank < world_size_, "peer_host of rank {} on rank {}", rank, rank_);
  // "host:port", where an IPv4 peer of the dual-stack listener shows as ::ffff:a.b.c.d.
  std::string host = peers_->ranks[rank].address;
  host = host.substr(0, host.rfind(':'));
  if (host.starts_with("::ffff:") && host.find('.') != std::string::npos) host = host.substr(7);
  return host;
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
