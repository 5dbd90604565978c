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
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "dist/launch_env.h"

namespace forge {

class TcpStore {
 public:
  // Rank 0: listens on env.master_port (all interfaces) and returns once every rank has
  // connected. Others: connect to env.master_addr:env.master_port. Throws forge::Error on
  // timeout, refusal or a broken peer. world_size 1 opens no socket.
  TcpStore(const LaunchEnv& env, std::chrono::milliseconds timeout);
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

 private:
  struct Peers;  // rank 0: the connections to ranks 1..world-1; others: the one to rank 0
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<Peers> peers_;
};

// Ranks as a compact list for messages: {1, 2, 3, 7} -> "1-3, 7".
std::string format_ranks(std::span<const int> ranks);

}  // namespace forge
