// The rendezvous before NCCL exists: rank 0 listens on MASTER_PORT, every other rank
// connects to MASTER_ADDR:MASTER_PORT, and over these star-shaped connections rank 0
// hands out the NCCL unique id (broadcast) and the ranks can meet (barrier).
//
// NOTE [TCP rendezvous]
// Every message is a frame: magic "FRGR", protocol version, type, payload length, payload.
// A connecting rank opens with HELLO (its rank and world size); rank 0 answers WELCOME once
// every rank has said hello, or ABORT with a reason. Rank 0 refuses, and tells everyone
// why, a peer with another magic or version (another program, another forge), another
// world size, a rank outside the world or a rank that is already there; a connection that
// does not speak the protocol at all is dropped with a warning, as port scanners exist.
//
// Nothing waits without a deadline. Rank 0 waits `timeout` for the others to arrive and
// then fails naming the ranks that never did, and sends that message to the ranks that
// did, so every log says the same. A peer retries connecting until `timeout`; whenever it
// then waits for rank 0 (for WELCOME, the broadcast, a barrier's release) it waits
// `timeout` plus a grace of min(timeout, 5 s). Rank 0 had started its clock by the time a
// peer got through, and usually reaches a barrier within the grace of the others, so its
// deadline passes first and the peer hears the reason rather than a bare timeout. A rank
// whose connection closes (its process died) ends rank 0's wait at once, named.
//
// NOTE [TCP messages]
// The CPU process group (cpu_process_group.h) sends tensors through rank 0 over these
// connections (the world's, or a store of a group's own, whose messages call each rank by
// its world rank): messages of any length, each a MESSAGE frame holding the length (u64) and
// then the bytes in PART frames of at most 1 MiB, the payload limit of every frame. The
// others send to rank 0 (send_to_root) and receive from it (receive_from_root); rank 0
// gathers one message from every rank (gather_at_root), answers each (send_to), or stops
// the job telling everyone why (abort). The waits are those above with the caller's
// timeout: rank 0 names the ranks that did not arrive or closed their connection and
// sends that verdict to the others; a rank waiting on rank 0 (also while its message does
// not fit into the connection yet, as rank 0 reads it only once it reaches the same call)
// gets that verdict, or fails on its own after the timeout plus the grace. Bytes are
// copied only into and out of the connection's buffer, never per frame of the message.
// These errors do not start with this rank's number: the caller names it.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "distributed/launch_env.h"
#include "distributed/tcp_socket.h"

namespace forge {

class TcpStore {
 public:
  // Rank 0: listens on env.master_port (all interfaces) and returns once every rank has
  // connected. Others: connect to env.master_addr:env.master_port. Throws forge::Error on
  // timeout, refusal or a broken peer. world_size 1 opens no socket.
  TcpStore(const LaunchEnv& env, std::chrono::milliseconds timeout);
  // The star of a group of a job (cpu_process_group.h), met the same way: rank 0 accepts
  // the others on `listener` (already listening on the port they were told), the others
  // connect to host:port. `names[r]` is the number messages give rank r (its world rank);
  // empty: r. world_size 1 opens no socket.
  TcpStore(int rank, int world_size, net::Fd listener, const std::string& host, int port, std::vector<int> names,
           std::chrono::milliseconds timeout);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Rank 0's bytes to every rank: rank 0 sends `data`, the others receive into it. Every
  // rank must pass the same size (checked).
  void broadcast(std::span<uint8_t> data);
  // Returns once every rank has called barrier().
  void barrier();

  // NOTE [TCP messages]. `stage` names the call in error messages.
  // Any rank but 0: sends `head` followed by `body` to rank 0 as one message.
  void send_to_root(std::span<const uint8_t> head, std::span<const uint8_t> body, std::chrono::milliseconds timeout,
                    std::string_view stage);
  // Any rank but 0: rank 0's next message; the second form receives it into `data`, which
  // must be its size.
  std::vector<uint8_t> receive_from_root(std::chrono::milliseconds timeout, std::string_view stage);
  void receive_from_root(std::span<uint8_t> data, std::chrono::milliseconds timeout, std::string_view stage);
  // Rank 0: one message from every other rank, indexed by rank ([0] is empty).
  std::vector<std::vector<uint8_t>> gather_at_root(std::chrono::milliseconds timeout, std::string_view stage);
  // Rank 0: sends `data` to `rank` as one message.
  void send_to(int rank, std::span<const uint8_t> data, std::chrono::milliseconds timeout, std::string_view stage);
  // Rank 0: tells every other rank that the job stops because of `reason` (best effort),
  // then throws it. The store is unusable afterwards, as after any failure.
  [[noreturn]] void abort(const std::string& reason);
  // Rank 0, after gather_at_root failed: the rank it blamed when that was one rank (it did
  // not arrive in time, or closed its connection); -1 otherwise.
  int culprit() const;
  // Rank 0: the host (an IP address) rank `rank`'s connection comes from, as another rank
  // of its network would reach it.
  std::string peer_host(int rank) const;
  // The host the others reach rank 0 at (MASTER_ADDR for the world's store).
  const std::string& root_host() const { return host_; }

 private:
  struct Peers;  // rank 0: the connections to ranks 1..world-1; others: the one to rank 0
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::string host_;
  std::unique_ptr<Peers> peers_;

  void meet(net::Fd listener, int port);
};

// Ranks as a compact list for messages: {1, 2, 3, 7} -> "1-3, 7".
std::string format_ranks(std::span<const int> ranks);

}  // namespace forge
