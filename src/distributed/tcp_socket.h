// Plain TCP for the rendezvous (tcp_store.h): listen, accept, connect with retries, and
// send / receive that never wait past a deadline. Every socket is non-blocking and every
// wait is a poll() bounded by the caller's deadline, so no call here can hang a rank.
// Errors throw forge::Error naming the host, port and the system's reason.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace forge::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

// Milliseconds left until `deadline` (0 when past), for poll().
int milliseconds_until(Deadline deadline);

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(other.release()) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// Listens on `port` of every local interface (IPv6 and IPv4 where the host has both).
Fd listen_tcp(int port);
// The port a listening socket is bound to (the one the system picked for port 0).
int bound_port(const Fd& listener);
// Accepts one pending connection, or returns an invalid Fd when none is pending.
// `peer` receives the remote address for messages.
Fd accept_tcp(const Fd& listener, std::string& peer);

// Connects to host:port, resolving the name again and retrying while the connection is
// refused or the host unreachable (rank 0 not listening yet), until `deadline`.
Fd connect_tcp(const std::string& host, int port, Deadline deadline);

// Sends every byte or throws (peer gone, or `deadline` passed); `what` names the peer.
// While the socket takes no more bytes and the peer has sent something (or closed),
// calls `on_readable`, when given, which reads it and may throw to end the send.
void send_all(const Fd& fd, std::span<const uint8_t> bytes, Deadline deadline, std::string_view what,
              const std::function<void()>& on_readable = {});
// Appends whatever can be read now without blocking; false when the peer closed the
// connection (or reset it) and nothing more will come.
bool read_available(const Fd& fd, std::vector<uint8_t>& buffer);

// Little-endian integers of `bytes` bytes (1..8), as forge's wire frames (the rendezvous,
// NOTE [TCP rendezvous], and the heartbeat) spell them.
void put_le(std::vector<uint8_t>& out, uint64_t value, int bytes);
uint64_t get_le(const uint8_t* p, int bytes);

// A wait as messages give it: "2.5 s".
std::string seconds_text(std::chrono::milliseconds wait);

}  // namespace forge::net
