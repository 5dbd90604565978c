// The CPU process group (NOTE [CPU process group] in cpu_process_group.h). Every call is a
// round under the world's lock: the other ranks send rank 0 their call and input and wait
// for their result; rank 0 gathers every rank's call, checks that they match, and then
// computes and sends each group's results, group by group.
#include "distributed/cpu_process_group.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/error.h"
#include "distributed/flight_recorder.h"
#include "distributed/heartbeat.h"
#include "distributed/point_to_point.h"
#include "distributed/tcp_store.h"

namespace forge {
namespace {

enum class Kind : uint32_t { AllReduce = 1, ReduceScatter = 2, AllGather = 3, Barrier = 4, Split = 5, AllToAll = 6,
                            SendRecv = 7 };

// One rank's part in a round: the head of its message to rank 0, before its input.
struct Call {
  uint32_t group = 0;  // 0 is the world
  Kind kind = Kind::Barrier;
  uint64_t number = 0;  // the how-many-th call on the group this is, from 1
  DType dtype = DType::F32;
  ReduceOp op = ReduceOp::Sum;
  uint64_t input = 0;   // elements the rank sends
  uint64_t output = 0;  // elements it gets back
  int32_t color = 0;    // split only
  int32_t key = 0;
  uint64_t row = 0;  // all_to_all only: elements per row
  uint64_t ops = 0;  // send_recv only: how many ops the rank lists
};
constexpr size_t kCallBytes = 64;
// An all_to_all's message carries, between the call and the rows, the rank's send and
// then receive counts: one u64 per rank of the group, each.
constexpr size_t kCountBytes = 8;
// A send_recv's call counts bytes (dtype u8: input is what the rank sends, output what it
// receives); its message carries, between the call and the send payloads (concatenated
// in op order), its ops: kind (0 send, 1 receive), peer (rank in the group) and byte
// count, a u64 each.
constexpr size_t kOpWords = 3;

void put(std::vector<uint8_t>& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(value >> (8 * i)));
}
uint64_t get(const uint8_t*& p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) value |= uint64_t(p[i]) << (8 * i);
  p += bytes;
  return value;
}

std::vector<uint8_t> encode(const Call& c) {
  std::vector<uint8_t> out;
  put(out, c.group, 4);
  put(out, static_cast<uint32_t>(c.kind), 4);
  put(out, c.number, 8);
  put(out, static_cast<uint32_t>(c.dtype), 4);
  put(out, static_cast<uint32_t>(c.op), 4);
  put(out, c.input, 8);
  put(out, c.output, 8);
  put(out, static_cast<uint32_t>(c.color), 4);
  put(out, static_cast<uint32_t>(c.key), 4);
  put(out, c.row, 8);
  put(out, c.ops, 8);
  return out;
}

Call decode(const uint8_t* p) {
  Call c;
  c.group = static_cast<uint32_t>(get(p, 4));
  c.kind = static_cast<Kind>(get(p, 4));
  c.number = get(p, 8);
  c.dtype = static_cast<DType>(get(p, 4));
  c.op = static_cast<ReduceOp>(get(p, 4));
  c.input = get(p, 8);
  c.output = get(p, 8);
  c.color = static_cast<int32_t>(get(p, 4));
  c.key = static_cast<int32_t>(get(p, 4));
  c.row = get(p, 8);
  c.ops = get(p, 8);
  return c;
}

// "all_reduce #3 (bf16, 4096 elements, sum)": everything that must match across the ranks
// of a group (a split's color and key need not).
std::string call_text(const Call& c) {
  const std::string_view dtype = dtype_name(c.dtype);
  const char* op = reduce_op_name(c.op);
  switch (c.kind) {
    case Kind::AllReduce:
      return fmt::format("all_reduce #{} ({}, {} elements, {})", c.number, dtype, c.input, op);
    case Kind::ReduceScatter:
      return fmt::format("reduce_scatter #{} ({}, {} elements per rank, {})", c.number, dtype, c.output, op);
    case Kind::AllGather:
      return fmt::format("all_gather #{} ({}, {} elements per rank)", c.number, dtype, c.input);
    case Kind::Barrier:
      return fmt::format("barrier #{}", c.number);
    case Kind::Split:
      return fmt::format("split #{}", c.number);
    case Kind::AllToAll:  // the row counts differ from rank to rank
      return fmt::format("all_to_all #{} ({}, rows of {} elements)", c.number, dtype, c.row);
    case Kind::SendRecv:  // the ops differ from rank to rank
      return fmt::format("send_recv #{}", c.number);
  }
  return fmt::format("an unknown collective ({})", static_cast<uint32_t>(c.kind));
}

// An all_to_all's send and receive counts, or a send_recv's op words, as sent (u64 each);
// empty for other calls.
std::vector<int64_t> decode_counts(std::span<const uint8_t> bytes) {
  std::vector<int64_t> counts(bytes.size() / kCountBytes);
  const uint8_t* p = bytes.data();
  for (int64_t& n : counts) n = static_cast<int64_t>(get(p, kCountBytes));
  return counts;
}

// A send_recv's ops as its message carries them (kOpWords).
std::vector<uint8_t> encode_ops(const std::vector<PointToPointShape>& ops) {
  std::vector<uint8_t> out;
  for (const PointToPointShape& op : ops) {
    put(out, op.kind == PointToPoint::Kind::Send ? 0 : 1, kCountBytes);
    put(out, static_cast<uint64_t>(op.peer), kCountBytes);
    put(out, op.bytes, kCountBytes);
  }
  return out;
}

// A send_recv round as rank 0 routes it: each member's ops (in group rank order) and how
// they pair up.
struct SendRecvRound {
  std::vector<std::vector<PointToPointShape>> ops;
  std::vector<PointToPointTransfer> transfers;
};

// Shows at most 8 of `lines`, joined, then how many more there were.
std::string first_lines(std::vector<std::string> lines) {
  constexpr size_t kShown = 8;
  const size_t more = lines.size() > kShown ? lines.size() - kShown : 0;
  lines.resize(lines.size() - more);
  return fmt::format("{}{}", fmt::join(lines, "; "), more ? fmt::format(" (and {} more)", more) : "");
}

std::string group_text(uint32_t id, std::span<const int> members) {
  return id == 0 ? std::string("the world") : fmt::format("group {} (world ranks {})", id, format_ranks(members));
}

std::span<uint8_t> bytes_of(const Tensor& t) { return {static_cast<uint8_t*>(t.raw()), t.nbytes()}; }

// The sum (or mean, or maximum) of `inputs`, `count` elements of `dtype` each, added (or
// compared, a NaN winning) in their order in fp32 and rounded to `dtype` once.
float combine(float acc, float value, ReduceOp op) {
  if (op != ReduceOp::Max) return acc + value;
  return std::isnan(acc) || value <= acc ? acc : value;  // NaN wins
}

std::vector<uint8_t> reduce(const std::vector<std::span<const uint8_t>>& inputs, size_t count, DType dtype,
                            ReduceOp op) {
  std::vector<uint8_t> result(count * dtype_size(dtype));
  std::vector<float> widened;
  float* sum = nullptr;
  if (dtype == DType::F32) {
    sum = reinterpret_cast<float*>(result.data());
  } else {
    widened.resize(count);
    sum = widened.data();
  }
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (dtype == DType::F32) {
      const float* in = reinterpret_cast<const float*>(inputs[k].data());
      if (k == 0) {
        std::copy(in, in + count, sum);
      } else {
        for (size_t i = 0; i < count; ++i) sum[i] = combine(sum[i], in[i], op);
      }
    } else {
      const BFloat16* in = reinterpret_cast<const BFloat16*>(inputs[k].data());
      if (k == 0) {
        for (size_t i = 0; i < count; ++i) sum[i] = to_float(in[i]);
      } else {
        for (size_t i = 0; i < count; ++i) sum[i] = combine(sum[i], to_float(in[i]), op);
      }
    }
  }
  if (op == ReduceOp::Avg) {
    const float n = static_cast<float>(inputs.size());
    for (size_t i = 0; i < count; ++i) sum[i] /= n;
  }
  if (dtype == DType::BF16) {
    BFloat16* out = reinterpret_cast<BFloat16*>(result.data());
    for (size_t i = 0; i < count; ++i) out[i] = to_bf16(sum[i]);
  }
  return result;
}

// A split's answer to one rank: the new group's id and its members (world ranks, in its
// rank order).
std::vector<uint8_t> encode_group(uint32_t id, const std::vector<int>& members) {
  std::vector<uint8_t> out;
  put(out, id, 4);
  put(out, members.size(), 4);
  for (int m : members) put(out, static_cast<uint32_t>(m), 4);
  return out;
}

std::pair<uint32_t, std::vector<int>> decode_group(const std::vector<uint8_t>& bytes) {
  FORGE_CHECK(bytes.size() >= 8, "split answer of {} bytes", bytes.size());
  const uint8_t* p = bytes.data();
  const auto id = static_cast<uint32_t>(get(p, 4));
  const auto count = static_cast<size_t>(get(p, 4));
  FORGE_CHECK(bytes.size() == 8 + 4 * count, "split answer of {} bytes for {} ranks", bytes.size(), count);
  std::vector<int> members(count);
  for (int& m : members) m = static_cast<int>(get(p, 4));
  return {id, std::move(members)};
}

// What every group of one world shares: the connections, and on rank 0 the members of
// every group. Lives as long as any of its groups.
struct World {
  World(const LaunchEnv& env, const ProcessGroupOptions& options)
      : store(env, options.rendezvous_timeout), rank(env.rank), size(env.world_size), options(options) {
    std::vector<int> everyone(size);
    std::iota(everyone.begin(), everyone.end(), 0);
    groups[0] = std::move(everyone);
    if (options.heartbeat_timeout.count() > 0)
      heartbeat = std::make_unique<Heartbeat>(store, env, HeartbeatOptions{options.heartbeat_timeout,
                                                                           options.rendezvous_timeout, {}});
  }

  std::mutex mu;  // one round at a time, whichever group it is on
  TcpStore store;
  const int rank;
  const int size;
  const ProcessGroupOptions options;
  std::string failure;  // once a round failed: the message every later call throws
  // Rank 0: every group's members (world ranks, in the group's rank order), by id.
  std::map<uint32_t, std::vector<int>> groups;
  uint32_t next_group = 1;
  std::unique_ptr<Heartbeat> heartbeat;  // NOTE [Failure detection]; after `store`, so it goes first
};

class CpuProcessGroup final : public ProcessGroup {
 public:
  CpuProcessGroup(std::shared_ptr<World> world, uint32_t id, std::vector<int> members)
      : world_(std::move(world)), id_(id), members_(std::move(members)), name_(group_text(id_, members_)) {
    const auto me = std::find(members_.begin(), members_.end(), world_->rank);
    FORGE_CHECK(me != members_.end(), "rank {} is not in {}", world_->rank, name_);
    rank_ = static_cast<int>(me - members_.begin());
  }
  ~CpuProcessGroup() override { destroy(); }

  int rank() const override { return rank_; }
  int world_size() const override { return static_cast<int>(members_.size()); }

  void all_reduce(const Tensor& tensor, ReduceOp op, CudaStream) override {
    check_open("all_reduce");
    check_all_reduce(tensor, Device::CPU);
    Call call;
    call.kind = Kind::AllReduce;
    call.dtype = tensor.dtype();
    call.op = op;
    call.input = call.output = static_cast<uint64_t>(tensor.numel());
    run(call, bytes_of(tensor), bytes_of(tensor));
  }

  void reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op, CudaStream) override {
    check_open("reduce_scatter");
    check_reduce_scatter(output, input, world_size(), Device::CPU);
    Call call;
    call.kind = Kind::ReduceScatter;
    call.dtype = input.dtype();
    call.op = op;
    call.input = static_cast<uint64_t>(input.numel());
    call.output = static_cast<uint64_t>(output.numel());
    run(call, bytes_of(input), bytes_of(output));
  }

  void all_gather(const Tensor& output, const Tensor& input, CudaStream) override {
    check_open("all_gather");
    check_all_gather(output, input, world_size(), Device::CPU);
    Call call;
    call.kind = Kind::AllGather;
    call.dtype = input.dtype();
    call.input = static_cast<uint64_t>(input.numel());
    call.output = static_cast<uint64_t>(output.numel());
    run(call, bytes_of(input), bytes_of(output));
  }

  void all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                  const std::vector<int64_t>& send_counts, CudaStream) override {
    check_open("all_to_all");
    check_all_to_all(output, recv_counts, input, send_counts, world_size(), Device::CPU);
    const int64_t row = row_elements(input);
    const size_t row_bytes = static_cast<size_t>(row) * dtype_size(input.dtype());
    int64_t sent = 0;
    int64_t received = 0;
    std::vector<uint8_t> counts;
    for (int64_t n : send_counts) {
      put(counts, static_cast<uint64_t>(n), kCountBytes);
      sent += n;
    }
    for (int64_t n : recv_counts) {
      put(counts, static_cast<uint64_t>(n), kCountBytes);
      received += n;
    }
    Call call;
    call.kind = Kind::AllToAll;
    call.dtype = input.dtype();
    call.row = static_cast<uint64_t>(row);
    call.input = static_cast<uint64_t>(sent * row);
    call.output = static_cast<uint64_t>(received * row);
    run(call, bytes_of(input).first(static_cast<size_t>(sent) * row_bytes),
        bytes_of(output).first(static_cast<size_t>(received) * row_bytes), counts);
  }

  // The ops' words and send payloads go to rank 0, which answers with this rank's
  // received bytes in op order (NOTE [Point-to-point]).
  void send_recv(const std::vector<PointToPoint>& ops, CudaStream) override {
    check_open("send_recv");
    check_send_recv(ops, world_size(), Device::CPU);
    const std::vector<PointToPointShape> shapes = shapes_of(ops);
    std::vector<uint8_t> payload;
    uint64_t received = 0;
    for (const PointToPoint& op : ops) {
      if (op.kind == PointToPoint::Kind::Send) {
        const std::span<const uint8_t> bytes = bytes_of(op.tensor);
        payload.insert(payload.end(), bytes.begin(), bytes.end());
      } else {
        received += op.tensor.nbytes();
      }
    }
    std::vector<uint8_t> result(received);
    Call call;
    call.kind = Kind::SendRecv;
    call.dtype = DType::U8;
    call.input = payload.size();
    call.output = received;
    call.ops = ops.size();
    run(call, payload, result, encode_ops(shapes));
    const std::vector<uint64_t> offsets = payload_offsets(shapes);
    for (size_t i = 0; i < ops.size(); ++i)
      if (ops[i].kind == PointToPoint::Kind::Recv && shapes[i].bytes > 0)
        std::memcpy(ops[i].tensor.raw(), result.data() + offsets[i], shapes[i].bytes);
  }

  void barrier() override {
    check_open("barrier");
    Call call;
    call.kind = Kind::Barrier;
    run(call, {}, {});
  }

  std::unique_ptr<ProcessGroup> split(int color, int key) override {
    check_open("split");
    check_split(color);
    Call call;
    call.kind = Kind::Split;
    call.color = color;
    call.key = key;
    std::vector<uint8_t> answer;
    round(call, [&](const std::string& stage) {
      if (world_->rank == 0) {
        answer = serve(call, {}, {}, stage);
      } else {
        world_->store.send_to_root(encode(call), {}, world_->options.collective_timeout, stage);
        answer = world_->store.receive_from_root(world_->options.collective_timeout, stage);
      }
    });
    auto [id, members] = decode_group(answer);
    return std::make_unique<CpuProcessGroup>(world_, id, std::move(members));
  }

  // Nothing is in flight between calls; the world's connections close with its last group.
  void destroy() override { world_.reset(); }

 private:
  void check_open(const char* what) const {
    FORGE_CHECK(world_ != nullptr, "{} on a process group after destroy()", what);
  }

  // Runs one round of `call` on this group: `body` does the talking, under the world's
  // lock; a failure is recorded for every group of the world, reported, and thrown.
  template <typename Body>
  void round(Call& call, Body&& body) {
    World& w = *world_;
    std::lock_guard lock(w.mu);
    if (!w.failure.empty()) throw Error(w.failure);
    call.group = id_;
    call.number = ++calls_;
    const std::string stage = fmt::format("{} on {}", call_text(call), name_);
    const uint64_t record = flight_record_start(name_, call_text(call));
    try {
      body(stage);
    } catch (const Error& e) {
      w.failure = fmt::format("rank {} of {}: {}", w.rank, w.size, e.what());
      if (w.heartbeat) w.heartbeat->fail(w.failure, w.rank == 0 ? w.store.culprit() : -1);
      if (w.options.on_failure) w.options.on_failure(w.failure);
      throw Error(w.failure);
    }
    flight_record_end(record);
  }

  // A collective: `input` goes to rank 0, this rank's result comes back into `output`.
  // `counts`: an all_to_all's send and receive counts, or a send_recv's op words, sent
  // between the call and `input`.
  void run(Call& call, std::span<const uint8_t> input, std::span<uint8_t> output,
           std::span<const uint8_t> counts = {}) {
    round(call, [&](const std::string& stage) {
      World& w = *world_;
      if (w.rank == 0) {
        serve(call, input, output, stage, counts);
        return;
      }
      std::vector<uint8_t> head = encode(call);
      head.insert(head.end(), counts.begin(), counts.end());
      w.store.send_to_root(head, input, w.options.collective_timeout, stage);
      w.store.receive_from_root(output, w.options.collective_timeout, stage);
    });
  }

  // Rank 0's side of a round (its own call is `mine`, `my_counts` those of its
  // all_to_all): gathers the other ranks' calls, checks them, and answers each group.
  // Returns rank 0's answer to a split.
  std::vector<uint8_t> serve(const Call& mine, std::span<const uint8_t> input, std::span<uint8_t> output,
                             const std::string& stage, std::span<const uint8_t> my_counts = {}) {
    World& w = *world_;
    std::vector<std::vector<uint8_t>> messages = w.store.gather_at_root(w.options.collective_timeout, stage);
    std::vector<Call> calls(w.size);
    std::vector<std::span<const uint8_t>> inputs(w.size);
    std::vector<std::vector<int64_t>> counts(w.size);  // all_to_all: send, then receive counts; send_recv: op words
    calls[0] = mine;
    inputs[0] = input;
    counts[0] = decode_counts(my_counts);
    for (int r = 1; r < w.size; ++r) {
      if (messages[r].size() < kCallBytes) w.store.abort(fmt::format("{}: rank {} sent a malformed call", stage, r));
      calls[r] = decode(messages[r].data());
      inputs[r] = std::span<const uint8_t>(messages[r]).subspan(kCallBytes);
    }
    std::map<uint32_t, SendRecvRound> send_recvs;
    const std::map<uint32_t, const std::vector<int>*> groups = check_calls(calls, inputs, counts, send_recvs, stage);

    std::vector<uint8_t> own_answer;
    const auto deliver = [&](int r, std::span<const uint8_t> bytes) {
      if (r != 0) {
        w.store.send_to(r, bytes, w.options.collective_timeout, stage);
      } else if (!bytes.empty()) {
        std::memcpy(output.data(), bytes.data(), bytes.size());
      }
    };
    for (const auto& [id, members_of] : groups) {
      const std::vector<int>& members = *members_of;
      const Call& call = calls[members[0]];
      const size_t group_size = members.size();
      switch (call.kind) {
        case Kind::AllReduce:
        case Kind::ReduceScatter: {
          std::vector<std::span<const uint8_t>> group_inputs;
          for (int m : members) group_inputs.push_back(inputs[m]);
          const std::vector<uint8_t> result = reduce(group_inputs, call.input, call.dtype, call.op);
          const size_t chunk = call.output * dtype_size(call.dtype);
          for (size_t k = 0; k < group_size; ++k) {
            const std::span<const uint8_t> all(result);
            deliver(members[k], call.kind == Kind::AllReduce ? all : all.subspan(k * chunk, chunk));
          }
          break;
        }
        case Kind::AllGather: {
          std::vector<uint8_t> result(call.output * dtype_size(call.dtype));
          const size_t chunk = call.input * dtype_size(call.dtype);
          for (size_t k = 0; k < group_size; ++k)
            if (chunk > 0) std::memcpy(result.data() + k * chunk, inputs[members[k]].data(), chunk);
          for (int m : members) deliver(m, result);
          break;
        }
        case Kind::Barrier:
          for (int m : members) deliver(m, {});
          break;
        case Kind::AllToAll: {
          // Member j gets, from each member i in group rank order, i's rows for j.
          const size_t row_bytes = call.row * dtype_size(call.dtype);
          for (size_t j = 0; j < group_size; ++j) {
            std::vector<uint8_t> result(calls[members[j]].output * dtype_size(call.dtype));
            size_t at = 0;
            for (size_t i = 0; i < group_size; ++i) {
              const std::vector<int64_t>& send = counts[members[i]];
              int64_t offset = 0;
              for (size_t k = 0; k < j; ++k) offset += send[k];
              const size_t bytes = static_cast<size_t>(send[j]) * row_bytes;
              if (bytes > 0)
                std::memcpy(result.data() + at, inputs[members[i]].data() + static_cast<size_t>(offset) * row_bytes,
                            bytes);
              at += bytes;
            }
            deliver(members[j], result);
          }
          break;
        }
        case Kind::SendRecv: {
          // Each member's receives, in its op order, filled from the sends paired with them.
          const SendRecvRound& sr = send_recvs.at(id);
          std::vector<std::vector<uint8_t>> results(group_size);
          std::vector<std::vector<uint64_t>> offsets(group_size);
          for (size_t k = 0; k < group_size; ++k) {
            results[k].resize(calls[members[k]].output);
            offsets[k] = payload_offsets(sr.ops[k]);
          }
          for (const PointToPointTransfer& t : sr.transfers)
            if (t.bytes > 0)
              std::memcpy(results[t.to].data() + offsets[t.to][t.recv],
                          inputs[members[t.from]].data() + offsets[t.from][t.send], t.bytes);
          for (size_t k = 0; k < group_size; ++k) deliver(members[k], results[k]);
          break;
        }
        case Kind::Split:
          for (auto& [r, answer] : split_group(members, calls)) {
            if (r == 0) {
              own_answer = std::move(answer);
            } else {
              deliver(r, answer);
            }
          }
          break;
      }
    }
    return own_answer;
  }

  // Rank 0: checks that the members of every group in this round made the same call, and
  // that each input has the size its call says. Returns the groups of the round by id.
  // An all_to_all's counts (a send_recv's op words) are split off the front of the other
  // ranks' inputs into `counts` (rank 0's are there already), and checked against the
  // receivers'; each send_recv group's pairing goes into `send_recvs`.
  std::map<uint32_t, const std::vector<int>*> check_calls(const std::vector<Call>& calls,
                                                           std::vector<std::span<const uint8_t>>& inputs,
                                                           std::vector<std::vector<int64_t>>& counts,
                                                           std::map<uint32_t, SendRecvRound>& send_recvs,
                                                           const std::string& stage) {
    World& w = *world_;
    std::map<uint32_t, const std::vector<int>*> groups;
    std::vector<std::string> texts(w.size);
    for (int r = 0; r < w.size; ++r) {
      const auto group = w.groups.find(calls[r].group);
      if (group == w.groups.end())
        w.store.abort(fmt::format("{}: rank {} called {} on group {}, which rank 0 never made", stage, r,
                                  call_text(calls[r]), calls[r].group));
      groups[calls[r].group] = &group->second;
      texts[r] = fmt::format("{} on {}", call_text(calls[r]), group_text(calls[r].group, group->second));
    }
    bool match = true;
    for (int r = 0; r < w.size; ++r)
      for (int m : *groups[calls[r].group]) match = match && texts[m] == texts[r];
    if (!match) {
      std::vector<std::pair<std::string, std::vector<int>>> by_call;  // in order of first rank
      for (int r = 0; r < w.size; ++r) {
        auto same = std::find_if(by_call.begin(), by_call.end(), [&](const auto& c) { return c.first == texts[r]; });
        if (same == by_call.end()) {
          by_call.push_back({texts[r], {r}});
        } else {
          same->second.push_back(r);
        }
      }
      std::string list;
      for (const auto& [text, ranks] : by_call)
        list += fmt::format("{}{} {} called {}", list.empty() ? "" : "; ", ranks.size() > 1 ? "ranks" : "rank",
                            format_ranks(ranks), text);
      w.store.abort(fmt::format(
          "collectives do not match across ranks: {} (on the CPU every rank of the world takes part in every "
          "collective, on whichever group: all ranks must make the same calls in the same order)",
          list));
    }
    for (int r = 1; r < w.size; ++r) {
      const uint64_t count_bytes = calls[r].kind == Kind::AllToAll   ? 2 * kCountBytes * groups[calls[r].group]->size()
                                   : calls[r].kind == Kind::SendRecv ? kOpWords * kCountBytes * calls[r].ops
                                                                     : 0;
      const uint64_t expected = count_bytes + calls[r].input * dtype_size(calls[r].dtype);
      if (inputs[r].size() != expected)
        w.store.abort(fmt::format("{}: rank {} sent {} bytes for {}, which needs {}", stage, r, inputs[r].size(),
                                  texts[r], expected));
      counts[r] = decode_counts(inputs[r].first(count_bytes));
      inputs[r] = inputs[r].subspan(count_bytes);
    }
    for (const auto& [id, members_of] : groups) {
      const std::vector<int>& members = *members_of;
      if (calls[members[0]].kind == Kind::SendRecv) send_recvs[id] = pair_send_recv(members, calls, counts, texts);
      if (calls[members[0]].kind != Kind::AllToAll) continue;
      const size_t n = members.size();
      std::vector<std::string> mismatches;
      for (int m : members) {
        const std::vector<int64_t>& mine = counts[m];
        bool valid = mine.size() == 2 * n;
        uint64_t sent = 0;
        uint64_t received = 0;
        for (size_t j = 0; valid && j < n; ++j) {
          valid = mine[j] >= 0 && mine[n + j] >= 0;
          sent += static_cast<uint64_t>(mine[j]);
          received += static_cast<uint64_t>(mine[n + j]);
        }
        if (!valid || sent * calls[m].row != calls[m].input || received * calls[m].row != calls[m].output)
          w.store.abort(fmt::format("{}: rank {} sent row counts that do not add up to its rows", texts[m], m));
      }
      for (size_t i = 0; i < n; ++i) {
        const std::vector<int64_t>& mine = counts[members[i]];
        for (size_t j = 0; j < n; ++j) {
          const int64_t expects = counts[members[j]][n + i];
          if (mine[j] != expects)
            mismatches.push_back(fmt::format("rank {} sends {} rows to rank {}, which expects {} from it", members[i],
                                             mine[j], members[j], expects));
        }
      }
      if (!mismatches.empty())
        w.store.abort(fmt::format(
            "{}: the ranks' row counts do not match (every rank's send_counts[j] must equal rank j's "
            "recv_counts[its rank]; ranks are world ranks): {}",
            texts[members[0]], first_lines(std::move(mismatches))));
    }
    return groups;
  }

  // Rank 0: the ops of a send_recv group's members from their op words, checked against
  // their calls' byte counts, and paired across the group; a mismatch fails the round.
  SendRecvRound pair_send_recv(const std::vector<int>& members, const std::vector<Call>& calls,
                               const std::vector<std::vector<int64_t>>& counts, const std::vector<std::string>& texts) {
    World& w = *world_;
    const size_t n = members.size();
    SendRecvRound sr;
    for (int m : members) {
      const std::vector<int64_t>& words = counts[m];
      std::vector<PointToPointShape>& ops = sr.ops.emplace_back();
      bool valid = words.size() == kOpWords * calls[m].ops;
      uint64_t sent = 0;
      uint64_t received = 0;
      for (size_t i = 0; valid && i < calls[m].ops; ++i) {
        const int64_t kind = words[kOpWords * i];
        const int64_t peer = words[kOpWords * i + 1];
        const auto bytes = static_cast<uint64_t>(words[kOpWords * i + 2]);
        valid = (kind == 0 || kind == 1) && peer >= 0 && peer < static_cast<int64_t>(n);
        ops.push_back({kind == 0 ? PointToPoint::Kind::Send : PointToPoint::Kind::Recv, static_cast<int>(peer), bytes});
        (kind == 0 ? sent : received) += bytes;
      }
      if (!valid || sent != calls[m].input || received != calls[m].output)
        w.store.abort(fmt::format("{}: rank {} sent ops that do not add up to its bytes", texts[m], m));
    }
    PointToPointPairing pairing = pair_point_to_point(sr.ops, members);
    if (!pairing.mismatches.empty())
      w.store.abort(fmt::format(
          "{}: the ranks' sends and receives do not pair up (rank a's k-th send to rank b must be received by rank "
          "b's k-th receive from rank a, of as many bytes; ops are numbered in each rank's list, ranks are world "
          "ranks): {}",
          texts[members[0]], first_lines(std::move(pairing.mismatches))));
    sr.transfers = std::move(pairing.transfers);
    return sr;
  }

  // Rank 0: splits the group of `members` by the colors and keys of their calls, records
  // the new groups, and returns each member's answer.
  std::vector<std::pair<int, std::vector<uint8_t>>> split_group(const std::vector<int>& members,
                                                                const std::vector<Call>& calls) {
    World& w = *world_;
    std::map<int32_t, std::vector<std::pair<int32_t, size_t>>> by_color;  // color -> (key, rank in group)
    for (size_t k = 0; k < members.size(); ++k)
      by_color[calls[members[k]].color].push_back({calls[members[k]].key, k});
    std::vector<std::pair<int, std::vector<uint8_t>>> answers;
    for (auto& [color, entries] : by_color) {
      std::sort(entries.begin(), entries.end());
      std::vector<int> group;
      for (const auto& entry : entries) group.push_back(members[entry.second]);
      const uint32_t id = w.next_group++;
      w.groups[id] = group;
      const std::vector<uint8_t> answer = encode_group(id, group);
      for (int r : group) answers.push_back({r, answer});
    }
    return answers;
  }

  std::shared_ptr<World> world_;  // null once destroyed
  uint32_t id_;
  std::vector<int> members_;  // world ranks, in this group's rank order
  std::string name_;          // "the world", "group 2 (world ranks 1, 3)"
  int rank_ = 0;
  uint64_t calls_ = 0;
};

}  // namespace

std::unique_ptr<ProcessGroup> create_cpu_process_group(const LaunchEnv& env, const ProcessGroupOptions& options) {
  FORGE_CHECK(options.device == Device::CPU, "the CPU process group on {}", device_name(options.device));
  auto world = std::make_shared<World>(env, options);
  std::vector<int> everyone(env.world_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  return std::make_unique<CpuProcessGroup>(std::move(world), 0, std::move(everyone));
}

}  // namespace forge
