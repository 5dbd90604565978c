#include "distributed/tcp_socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/error.h"

namespace forge::net {
namespace {

// One connection attempt waits at most this long for the handshake, so a host name that
// resolves to several addresses moves on from one that drops packets.
constexpr auto kAttemptTimeout = std::chrono::seconds(10);
constexpr auto kFirstRetryDelay = std::chrono::milliseconds(20);
constexpr auto kMaxRetryDelay = std::chrono::milliseconds(500);

std::string errno_text(int err) { return std::strerror(err); }

void set_nodelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

std::string address_text(const sockaddr* addr, socklen_t len) {
  char host[NI_MAXHOST] = {};
  char port[NI_MAXSERV] = {};
  if (getnameinfo(addr, len, host, sizeof(host), port, sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return "an unknown address";
  return std::string(host) + ":" + port;
}

// Binds a listening socket of `family` to the wildcard address, or returns the errno.
int try_listen(int family, int port, Fd& out) {
  Fd fd(socket(family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return errno;
  int one = 1;
  setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc;
  if (family == AF_INET6) {
    int zero = 0;  // accept IPv4 clients too
    setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));
    sockaddr_in6 addr{};
    addr.sin6_family = AF_INET6;
    addr.sin6_addr = in6addr_any;
    addr.sin6_port = htons(static_cast<uint16_t>(port));
    rc = bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  } else {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_ANY);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    rc = bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  }
  if (rc != 0 || listen(fd.get(), SOMAXCONN) != 0) return errno;
  out = std::move(fd);
  return 0;
}

// One non-blocking connect to `addr`, waiting for the handshake until `deadline`.
// Returns the socket, or an invalid Fd with `error` set.
Fd try_connect(const addrinfo* addr, Deadline deadline, std::string& error) {
  Fd fd(socket(addr->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    error = errno_text(errno);
    return Fd();
  }
  if (connect(fd.get(), addr->ai_addr, addr->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) {
    error = errno_text(errno);
    return Fd();
  }
  pollfd p{fd.get(), POLLOUT, 0};
  const Deadline attempt_end = std::min(deadline, Clock::now() + kAttemptTimeout);
  int ready;
  do {
    ready = poll(&p, 1, milliseconds_until(attempt_end));
  } while (ready < 0 && errno == EINTR);
  if (ready <= 0) {
    error = "no answer to the connection request";
    return Fd();
  }
  int err = 0;
  socklen_t len = sizeof(err);
  getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    error = errno_text(err);
    return Fd();
  }
  return fd;
}

}  // namespace

int milliseconds_until(Deadline deadline) {
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) close(fd_);
    fd_ = other.release();
  }
  return *this;
}

Fd::~Fd() {
  if (fd_ >= 0) close(fd_);
}

Fd listen_tcp(int port) {
  Fd fd;
  int err = try_listen(AF_INET6, port, fd);
  if (err == EAFNOSUPPORT || err == EADDRNOTAVAIL) err = try_listen(AF_INET, port, fd);
  if (err != 0)
    FORGE_FAIL("cannot listen on TCP port {}: {}{}", port, errno_text(err),
               err == EADDRINUSE
                   ? " (another job or a leftover process on this node holds it: pick another MASTER_PORT)"
                   : "");
  return fd;
}

int bound_port(const Fd& listener) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    FORGE_FAIL("getsockname on the rendezvous socket: {}", errno_text(errno));
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

Fd accept_tcp(const Fd& listener, std::string& peer) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  Fd fd(accept4(listener.get(), reinterpret_cast<sockaddr*>(&addr), &len, SOCK_NONBLOCK | SOCK_CLOEXEC));
  if (!fd.valid()) {
    if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
      FORGE_FAIL("accepting a rendezvous connection: {}", errno_text(errno));
    return Fd();  // nothing pending, or a client that gave up: keep waiting
  }
  set_nodelay(fd.get());
  peer = address_text(reinterpret_cast<sockaddr*>(&addr), len);
  return fd;
}

Fd connect_tcp(const std::string& host, int port, Deadline deadline) {
  const std::string service = std::to_string(port);
  std::string last_error = "no attempt was made";
  auto delay = kFirstRetryDelay;
  while (true) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* list = nullptr;
    // Resolution is retried as well: in some clusters rank 0's name appears in DNS only
    // once its node or pod is up.
    const int gai = getaddrinfo(host.c_str(), service.c_str(), &hints, &list);
    if (gai != 0) {
      last_error = std::string("cannot resolve the host name: ") + gai_strerror(gai);
    } else {
      for (const addrinfo* a = list; a; a = a->ai_next) {
        Fd fd = try_connect(a, deadline, last_error);
        if (fd.valid()) {
          freeaddrinfo(list);
          set_nodelay(fd.get());
          return fd;
        }
      }
      freeaddrinfo(list);
    }
    if (Clock::now() + delay >= deadline) FORGE_FAIL("could not connect to {}:{}: {}", host, port, last_error);
    std::this_thread::sleep_for(delay);
    delay = std::min(delay * 2, kMaxRetryDelay);
  }
}

void send_all(const Fd& fd, std::span<const uint8_t> bytes, Deadline deadline, std::string_view what,
              const std::function<void()>& on_readable) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd.get(), bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<size_t>(n);
      continue;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) FORGE_FAIL("sending to {}: {}", what, errno_text(errno));
    pollfd p{fd.get(), static_cast<short>(POLLOUT | (on_readable ? POLLIN : 0)), 0};
    if (poll(&p, 1, milliseconds_until(deadline)) == 0) FORGE_FAIL("sending to {} timed out", what);
    if (on_readable && (p.revents & (POLLIN | POLLHUP | POLLERR))) on_readable();
  }
}

bool read_available(const Fd& fd, std::vector<uint8_t>& buffer) {
  // Received straight into `buffer`, in pieces large enough that a message of many MiB
  // takes few system calls.
  constexpr size_t kPiece = 256 << 10;
  while (true) {
    const size_t old_size = buffer.size();
    buffer.resize(old_size + kPiece);
    const ssize_t n = recv(fd.get(), buffer.data() + old_size, kPiece, 0);
    buffer.resize(old_size + static_cast<size_t>(std::max<ssize_t>(n, 0)));
    if (n > 0) continue;
    if (n == 0) return false;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return true;
    if (errno == ECONNRESET || errno == EPIPE) return false;
    FORGE_FAIL("reading from a rendezvous connection: {}", errno_text(errno));
  }
}

void put_le(std::vector<uint8_t>& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}

uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t(p[i]) << (8 * i);
  return value;
}

std::string seconds_text(std::chrono::milliseconds wait) { return fmt::format("{:g} s", wait.count() / 1000.0); }

}  // namespace forge::net
