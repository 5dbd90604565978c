// Pairing the ops of send_recv (point_to_point.h, NOTE [Point-to-point] in process_group.h).
#include "distributed/point_to_point.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <utility>

#include "core/error.h"

namespace forge {

std::vector<PointToPointShape> shapes_of(const std::vector<PointToPoint>& ops) {
  std::vector<PointToPointShape> shapes;
  shapes.reserve(ops.size());
  for (const PointToPoint& op : ops) shapes.push_back({op.kind, op.peer, op.tensor.nbytes()});
  return shapes;
}

PointToPointPairing pair_point_to_point(const std::vector<std::vector<PointToPointShape>>& ops,
                                        std::span<const int> names, int only) {
  // (from, to) -> the sender's send ops to `to` and the receiver's receive ops from
  // `from`, each in its rank's order.
  std::map<std::pair<int, int>, std::pair<std::vector<size_t>, std::vector<size_t>>> links;
  for (int r = 0; r < static_cast<int>(ops.size()); ++r) {
    for (size_t i = 0; i < ops[r].size(); ++i) {
      const PointToPointShape& op = ops[r][i];
      if (only >= 0 && (r != only || op.peer != only)) continue;
      if (op.kind == PointToPoint::Kind::Send) {
        links[{r, op.peer}].first.push_back(i);
      } else {
        links[{op.peer, r}].second.push_back(i);
      }
    }
  }
  PointToPointPairing out;
  for (const auto& [link, pair] : links) {
    const auto [a, b] = link;
    const auto& [sends, recvs] = pair;
    const std::string to = a == b ? std::string("itself") : fmt::format("rank {}", names[b]);
    const std::string from = a == b ? std::string("itself") : fmt::format("rank {}", names[a]);
    for (size_t k = 0; k < std::max(sends.size(), recvs.size()); ++k) {
      if (k >= recvs.size()) {
        out.mismatches.push_back(fmt::format("rank {}'s op {} sends {} bytes to {}, which lists no receive from rank {} "
                                             "for it",
                                             names[a], sends[k], ops[a][sends[k]].bytes, to, names[a]));
      } else if (k >= sends.size()) {
        out.mismatches.push_back(fmt::format("rank {}'s op {} receives {} bytes from {}, which lists no send to rank {} "
                                             "for it",
                                             names[b], recvs[k], ops[b][recvs[k]].bytes, from, names[b]));
      } else if (ops[a][sends[k]].bytes != ops[b][recvs[k]].bytes) {
        out.mismatches.push_back(fmt::format("rank {}'s op {} sends {} bytes to {}, whose op {} receives {} bytes",
                                             names[a], sends[k], ops[a][sends[k]].bytes, to, recvs[k],
                                             ops[b][recvs[k]].bytes));
      } else {
        out.transfers.push_back({a, sends[k], b, recvs[k], ops[a][sends[k]].bytes});
      }
    }
  }
  return out;
}

std::vector<uint64_t> payload_offsets(const std::vector<PointToPointShape>& ops) {
  std::vector<uint64_t> offsets(ops.size());
  uint64_t sent = 0;
  uint64_t received = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    uint64_t& at = ops[i].kind == PointToPoint::Kind::Send ? sent : received;
    offsets[i] = at;
    at += ops[i].bytes;
  }
  return offsets;
}

std::vector<PointToPointTransfer> check_send_recv_to_self(const std::vector<PointToPoint>& ops, int rank) {
  std::vector<std::vector<PointToPointShape>> all(static_cast<size_t>(rank) + 1);
  all[rank] = shapes_of(ops);
  std::vector<int> names(all.size());
  std::iota(names.begin(), names.end(), 0);
  PointToPointPairing pairing = pair_point_to_point(all, names, rank);
  FORGE_CHECK(pairing.mismatches.empty(),
              "send_recv: rank {}'s sends to itself do not pair up with its receives from itself (its k-th send to "
              "itself is received by its k-th receive from itself, of as many bytes): {}",
              rank, fmt::join(pairing.mismatches, "; "));
  return std::move(pairing.transfers);
}

}  // namespace forge
