// How the ops of one send_recv call pair up across the ranks of a group (NOTE
// [Point-to-point] in process_group.h): rank a's k-th send to rank b with rank b's k-th
// receive from rank a, of as many bytes. Rank 0 of the CPU group pairs every member's ops
// and routes the bytes by the result; every group pairs a rank's sends to itself with its
// receives from itself before anything moves (the one-rank group then copies by them;
// NCCL pairs the other ops on the GPU, unchecked).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "distributed/process_group.h"

namespace forge {

// An op without its tensor: what rank 0 of the CPU group learns of each rank's ops.
struct PointToPointShape {
  PointToPoint::Kind kind;
  int peer;
  uint64_t bytes;
};
std::vector<PointToPointShape> shapes_of(const std::vector<PointToPoint>& ops);

// A send and the receive it pairs with: op `send` of rank `from` and op `recv` of rank `to`.
struct PointToPointTransfer {
  int from;
  size_t send;
  int to;
  size_t recv;
  uint64_t bytes;
};

struct PointToPointPairing {
  std::vector<PointToPointTransfer> transfers;  // by sender, then receiver, then in order
  std::vector<std::string> mismatches;          // one line per send or receive left unpaired or paired unequal
};

// Pairs the ops of a group's ranks: ops[r] is rank r's list, whose peers index `ops`;
// names[r] is how messages call rank r (its world rank, on the CPU). With `only` >= 0,
// only that rank's ops to and from itself are paired (the others are ignored).
PointToPointPairing pair_point_to_point(const std::vector<std::vector<PointToPointShape>>& ops,
                                        std::span<const int> names, int only = -1);

// Where each op's bytes lie in its rank's send payload (sends) or receive result
// (receives): the ops of one kind, concatenated in their order.
std::vector<uint64_t> payload_offsets(const std::vector<PointToPointShape>& ops);

// The pairing of `ops`' sends to `rank` (this rank) with its receives from `rank`; throws
// a forge::Error naming the op indices when they do not pair up.
std::vector<PointToPointTransfer> check_send_recv_to_self(const std::vector<PointToPoint>& ops, int rank);

}  // namespace forge
