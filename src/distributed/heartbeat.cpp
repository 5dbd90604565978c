// The heartbeat thread of every rank (NOTE [Failure detection] in heartbeat.h). Frames on
// the heartbeat connections, little-endian: magic "FRHB" (u32), type (u8), value (i64:
// the rank for HELLO, the step for BEAT, the rank at fault or -1 for FAIL and VERDICT),
// text length (u32), text.
#include "distributed/heartbeat.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/exit_status.h"
#include "core/log.h"
#include "distributed/flight_recorder.h"
#include "distributed/tcp_socket.h"
#include "distributed/tcp_store.h"

namespace forge {
namespace {

using net::Clock;
using net::Deadline;
using net::seconds_text;

constexpr uint32_t kMagic = 0x42485246;  // the bytes "FRHB"
constexpr size_t kHeaderBytes = 17;
constexpr uint32_t kMaxText = 1 << 16;
constexpr auto kMaxInterval = std::chrono::milliseconds(1000);
constexpr auto kMinInterval = std::chrono::milliseconds(20);
// Sending to one rank must not hold up the others (a beat is tiny; a verdict a few KiB).
constexpr auto kSendTimeout = std::chrono::milliseconds(500);
// How long a peer that failed on its own waits for rank 0's verdict, which may say more.
constexpr auto kVerdictWait = std::chrono::seconds(2);

enum class Type : uint8_t { Hello = 1, Beat = 2, Bye = 3, Fail = 4, Verdict = 5 };

std::atomic<int64_t> g_step{0};

std::vector<uint8_t> frame(Type type, int64_t value, std::string_view text = {}) {
  text = text.substr(0, kMaxText);
  std::vector<uint8_t> out;
  net::put_le(out, kMagic, 4);
  net::put_le(out, static_cast<uint8_t>(type), 1);
  net::put_le(out, static_cast<uint64_t>(value), 8);
  net::put_le(out, text.size(), 4);
  out.insert(out.end(), text.begin(), text.end());
  return out;
}

struct Frame {
  Type type;
  int64_t value;
  std::string text;
};

// The next whole frame of `buffer` (consumed), nullopt when incomplete; throws on garbage.
std::optional<Frame> take_frame(std::vector<uint8_t>& buffer) {
  if (buffer.size() < kHeaderBytes) return std::nullopt;
  const uint8_t* p = buffer.data();
  const uint8_t type = p[4];
  const uint64_t length = net::get_le(p + 13, 4);
  if (net::get_le(p, 4) != kMagic || type < 1 || type > 5 || length > kMaxText)
    throw Error("sent something that is not a forge heartbeat");
  if (buffer.size() < kHeaderBytes + length) return std::nullopt;
  Frame f{static_cast<Type>(type), static_cast<int64_t>(net::get_le(p + 5, 8)),
          std::string(buffer.begin() + kHeaderBytes, buffer.begin() + static_cast<std::ptrdiff_t>(kHeaderBytes + length))};
  buffer.erase(buffer.begin(), buffer.begin() + static_cast<std::ptrdiff_t>(kHeaderBytes + length));
  return f;
}

std::string step_text(int64_t step) { return step > 0 ? fmt::format("in step {}", step) : "before its first step"; }

struct Failure {
  std::string reason;
  int at_fault = -1;
};

}  // namespace

// The running heartbeat of this process, for report_step (which beats at once, so that
// a rank killed right after starting a step is reported in that step).
std::mutex g_running_mu;
Heartbeat::State* g_running = nullptr;

struct Heartbeat::State {
  struct Peer {
    int rank = 0;
    net::Fd fd;
    std::string address;
    std::vector<uint8_t> buffer;
    Clock::time_point last_heard;
    int64_t step = 0;
    bool left = false;  // said goodbye, or failed and reported
  };

  int rank = 0;
  int world = 1;
  std::chrono::milliseconds timeout{};
  std::chrono::milliseconds interval{};
  std::function<void()> before_exit;
  std::mutex mu;
  std::condition_variable verdict_arrived;
  std::vector<Peer> peers;  // rank 0: ranks 1..world-1; others: rank 0
  std::optional<Failure> verdict;  // a peer: what rank 0 sent
  std::optional<Failure> detected;  // the first failure scan_locked found
  std::atomic<bool> stopping{false};
  std::atomic<bool> failing{false};
  net::Fd wake_read, wake_write;
  std::thread thread;

  void send_to(Peer& p, const std::vector<uint8_t>& bytes) {
    if (!p.fd.valid() || p.left) return;
    try {
      net::send_all(p.fd, bytes, Clock::now() + kSendTimeout, fmt::format("rank {}", p.rank));
    } catch (const Error&) {
      // A peer that cannot take a frame is found out by the reading side.
    }
  }

  // Reads what every connection holds and checks it; the first failure found now, if any
  // (also kept in `detected`).
  std::optional<Failure> scan_locked() {
    std::optional<Failure> found = check_locked();
    if (found && !detected) detected = found;
    return found;
  }

  std::optional<Failure> check_locked() {
    const Clock::time_point now = Clock::now();
    for (Peer& p : peers) {
      if (p.left || !p.fd.valid()) continue;
      bool open = true;
      try {
        open = net::read_available(p.fd, p.buffer);
      } catch (const Error&) {
        open = false;
      }
      try {
        while (std::optional<Frame> f = take_frame(p.buffer)) {
          p.last_heard = now;
          switch (f->type) {
            case Type::Beat:
              p.step = f->value;
              break;
            case Type::Bye:
              p.left = true;
              break;
            case Type::Fail:  // the peer waits for the verdict
              return Failure{fmt::format("rank {} failed {}: {}", p.rank, step_text(p.step), f->text),
                             static_cast<int>(f->value)};
            case Type::Verdict:
              p.left = true;
              return Failure{f->text, static_cast<int>(f->value)};
            case Type::Hello:
              break;
          }
        }
      } catch (const Error& e) {
        p.left = true;
        return Failure{fmt::format("rank {} ({}) {}", p.rank, p.address, e.what()), p.rank};
      }
      if (p.left) continue;
      if (!open) {
        p.left = true;
        return Failure{fmt::format("rank {} ({}) is gone: its heartbeat connection closed without a goodbye {} (its "
                                   "process exited, crashed or was killed)",
                                   p.rank, p.address, step_text(p.step)),
                       p.rank};
      }
      if (now - p.last_heard > timeout) {
        p.left = true;
        return Failure{fmt::format("rank {} ({}) sent no heartbeat for {} (parallelism.heartbeat_timeout_s), last {} "
                                   "(its process is stopped, or its host unreachable)",
                                   p.rank, p.address, seconds_text(timeout), step_text(p.step)),
                       p.rank};
      }
    }
    return std::nullopt;
  }

  void run() {
    Clock::time_point next_beat = Clock::now();
    while (!stopping) {
      std::vector<pollfd> fds{{wake_read.get(), POLLIN, 0}};
      for (const Peer& p : peers)
        if (!p.left && p.fd.valid()) fds.push_back({p.fd.get(), POLLIN, 0});
      poll(fds.data(), fds.size(), std::max(1, net::milliseconds_until(next_beat)));
      std::optional<Failure> failure;
      {
        std::lock_guard lock(mu);
        // Set under the lock with the goodbye: a peer that leaves after its goodbye is not
        // taken for a failure.
        if (stopping) return;
        failure = scan_locked();
        if (failure && rank != 0 && failing) {
          // The main thread is failing and waits for this verdict.
          verdict = failure;
          verdict_arrived.notify_all();
          return;
        }
        if (!failure && Clock::now() >= next_beat) {
          const std::vector<uint8_t> beat = frame(Type::Beat, g_step.load());
          for (Peer& p : peers) send_to(p, beat);
          next_beat = Clock::now() + interval;
        }
      }
      if (failure) die(failure->reason, failure->at_fault, /*from_thread=*/true);
    }
  }

  [[noreturn]] void die(std::string reason, int at_fault, bool from_thread) {
    if (failing.exchange(true)) {
      // Another thread of this process is already stopping it.
      while (true) std::this_thread::sleep_for(std::chrono::hours(1));
    }
    {
      std::unique_lock lock(mu);
      if (rank == 0) {
        // What the heartbeats know of the ranks that are gone, when a collective saw it first.
        if (!from_thread) {
          scan_locked();
          if (detected) {
            reason += "; heartbeat: " + detected->reason;
            if (at_fault < 0) at_fault = detected->at_fault;
          }
        }
        const std::vector<uint8_t> verdict_frame = frame(Type::Verdict, at_fault, reason);
        for (Peer& p : peers) send_to(p, verdict_frame);
      } else if (!from_thread) {
        // Usually rank 0 knows already (this rank fails with what rank 0 sent it), and its
        // verdict names the rank at fault: the heartbeat thread reads on while this waits.
        // Only without one is rank 0 told, so that it never takes an echo of its own
        // verdict for news.
        if (verdict_arrived.wait_for(lock, kVerdictWait, [&] { return verdict.has_value(); })) {
          reason += "; rank 0's verdict: " + verdict->reason;
          if (at_fault < 0) at_fault = verdict->at_fault;
        } else {
          send_to(peers[0], frame(Type::Fail, at_fault, reason));
        }
      }
    }
    log_error("rank {} of {} stops {}: {}\nflight record of rank {}:{}", rank, world, step_text(g_step.load()), reason,
              rank, flight_record_text());
    if (before_exit) before_exit();
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(at_fault >= 0 && at_fault != rank ? kExitPeerFailed : 1);
  }
};

Heartbeat::Heartbeat(TcpStore& store, const LaunchEnv& env, HeartbeatOptions options) {
  if (env.world_size == 1) return;
  auto s = std::make_shared<State>();
  s->rank = env.rank;
  s->world = env.world_size;
  s->timeout = options.timeout;
  s->interval = std::clamp(options.timeout / 10, std::chrono::milliseconds(kMinInterval),
                           std::chrono::milliseconds(kMaxInterval));
  s->before_exit = std::move(options.before_exit);
  const Deadline deadline = Clock::now() + options.rendezvous_timeout;
  const std::string where = fmt::format("{}", env.master_addr);
  std::vector<uint8_t> port(4, 0);
  net::Fd listener;
  if (env.rank == 0) {
    listener = net::listen_tcp(0);
    const int p = net::bound_port(listener);
    for (int i = 0; i < 4; ++i) port[i] = static_cast<uint8_t>(p >> (8 * i));
  }
  store.broadcast(port);
  const int heartbeat_port = static_cast<int>(net::get_le(port.data(), 4));
  if (env.rank == 0) {
    s->peers.resize(env.world_size - 1);
    for (int r = 1; r < env.world_size; ++r) s->peers[r - 1].rank = r;
    std::vector<State::Peer> pending;
    int joined = 0;
    while (joined < env.world_size - 1) {
      std::vector<pollfd> fds{{listener.get(), POLLIN, 0}};
      for (const State::Peer& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
      if (poll(fds.data(), fds.size(), net::milliseconds_until(deadline)) == 0 || Clock::now() >= deadline) {
        std::vector<int> missing;
        for (const State::Peer& p : s->peers)
          if (!p.fd.valid()) missing.push_back(p.rank);
        FORGE_FAIL("heartbeat: rank{} {} did not connect to rank 0's heartbeat port {} within {}",
                   missing.size() > 1 ? "s" : "", format_ranks(missing), heartbeat_port,
                   seconds_text(options.rendezvous_timeout));
      }
      while (true) {
        State::Peer p;
        p.fd = net::accept_tcp(listener, p.address);
        if (!p.fd.valid()) break;
        pending.push_back(std::move(p));
      }
      for (size_t i = 0; i < pending.size();) {
        State::Peer& p = pending[i];
        bool settled = false;
        try {
          const bool open = net::read_available(p.fd, p.buffer);
          if (std::optional<Frame> f = take_frame(p.buffer)) {
            const int r = static_cast<int>(f->value);
            if (f->type != Type::Hello || r < 1 || r >= env.world_size || s->peers[r - 1].fd.valid())
              throw Error(fmt::format("opened with a bad HELLO (rank {})", f->value));
            State::Peer& slot = s->peers[r - 1];
            slot.fd = std::move(p.fd);
            slot.address = p.address;
            slot.buffer = std::move(p.buffer);
            ++joined;
            settled = true;
          } else if (!open) {
            throw Error("closed without introducing itself");
          }
        } catch (const Error& e) {
          log_warn("heartbeat: dropped a connection from {}: {}", p.address, e.what());
          settled = true;
        }
        if (settled) {
          pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          ++i;
        }
      }
    }
  } else {
    s->peers.resize(1);
    State::Peer& root = s->peers[0];
    root.rank = 0;
    root.address = fmt::format("{}:{}", where, heartbeat_port);
    try {
      root.fd = net::connect_tcp(env.master_addr, heartbeat_port, deadline);
      net::send_all(root.fd, frame(Type::Hello, env.rank), deadline, "rank 0");
    } catch (const Error& e) {
      FORGE_FAIL("rank {}: heartbeat: cannot reach rank 0 at {}: {}", env.rank, root.address, e.what());
    }
  }
  int wake[2];
  if (pipe2(wake, O_CLOEXEC | O_NONBLOCK) != 0) FORGE_FAIL("heartbeat: pipe: {}", std::strerror(errno));
  s->wake_read = net::Fd(wake[0]);
  s->wake_write = net::Fd(wake[1]);
  for (State::Peer& p : s->peers) p.last_heard = Clock::now();
  s->thread = std::thread([raw = s.get()] { raw->run(); });
  {
    std::lock_guard running(g_running_mu);
    g_running = s.get();
  }
  state_ = std::move(s);
}

Heartbeat::~Heartbeat() {
  if (!state_) return;
  State& s = *state_;
  {
    std::lock_guard running(g_running_mu);
    if (g_running == &s) g_running = nullptr;
  }
  {
    std::lock_guard lock(s.mu);
    s.stopping = true;
    if (std::uncaught_exceptions() == 0) {
      const std::vector<uint8_t> bye = frame(Type::Bye, 0);
      for (State::Peer& p : s.peers) s.send_to(p, bye);
    } else {
      // An error ends this rank; the process prints it once the stack has unwound.
      const std::string why = "it is exiting on an error (its log says which)";
      const std::vector<uint8_t> last =
          s.rank == 0 ? frame(Type::Verdict, 0, fmt::format("rank 0 failed {}: {}", step_text(g_step.load()), why))
                      : frame(Type::Fail, s.rank, why);
      for (State::Peer& p : s.peers) s.send_to(p, last);
    }
  }
  const char byte = 1;
  [[maybe_unused]] ssize_t ignored = write(s.wake_write.get(), &byte, 1);
  if (s.thread.joinable()) s.thread.join();
}

void Heartbeat::fail(const std::string& reason, int at_fault) {
  if (!state_) {
    log_error("{}\nflight record of this rank:{}", reason, flight_record_text());
    std::fflush(stdout);
    std::fflush(stderr);
    _exit(1);
  }
  state_->die(reason, at_fault, /*from_thread=*/false);
}

void report_step(int64_t step) {
  g_step.store(step);
  std::lock_guard running(g_running_mu);
  if (!g_running) return;
  std::lock_guard lock(g_running->mu);
  const std::vector<uint8_t> beat = frame(Type::Beat, step);
  for (Heartbeat::State::Peer& p : g_running->peers) g_running->send_to(p, beat);
}
int64_t reported_step() { return g_step.load(); }

void debug_hang_if_requested(int rank, int64_t step) {
  static const std::optional<std::pair<int, int64_t>> hang = []() -> std::optional<std::pair<int, int64_t>> {
    const char* value = std::getenv("FORGE_DEBUG_HANG_AT");
    if (!value || !*value) return std::nullopt;
    const char* restarts = std::getenv("FORGE_RESTART_COUNT");
    int r = -1;
    long long s = -1;
    char extra = 0;
    if (std::sscanf(value, "%d:%lld%c", &r, &s, &extra) != 2 || r < 0 || s < 1)
      FORGE_FAIL("FORGE_DEBUG_HANG_AT '{}': expected RANK:STEP (a test hook), e.g. 2:3", value);
    if (restarts && std::strcmp(restarts, "0") != 0) return std::nullopt;
    return std::pair<int, int64_t>{r, s};
  }();
  if (!hang || hang->first != rank || hang->second != step) return;
  log_warn("FORGE_DEBUG_HANG_AT: rank {} (pid {}) hangs at the start of step {} (a test hook)", rank, getpid(), step);
  std::fflush(stderr);
  while (true) std::this_thread::sleep_for(std::chrono::hours(1));
}

}  // namespace forge
