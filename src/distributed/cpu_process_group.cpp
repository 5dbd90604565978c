// The CPU process group (NOTE [CPU process group] in cpu_process_group.h). Every call is a
// round on the group's own connections, under its lock: the other ranks send its rank 0
// their call and input and wait for their result; rank 0 gathers every rank's call,
// checks that they match, and then computes and sends each rank's result.
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
constexpr size_t kCallBytes = 60;
// An all_to_all's message carries, between the call and the rows, the rank's send and
// then receive counts: one u64 per rank of the group, each.
constexpr size_t kCountBytes = 8;
// A send_recv's call counts bytes (dtype u8: input is what the rank sends, output what it
// receives); its message carries, between the call and the send payloads (concatenated
// in op order), its ops: kind (0 send, 1 receive), peer (rank in the group) and byte
// count, a u64 each.
constexpr size_t kOpWords = 3;
// A split's message carries, after the call, the port (u64) on which the rank listens in
// case it becomes the rank 0 of its new group; 0 when its group has one rank.

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

// "the world", "group 2 (world ranks 1, 3)", "group 2.1 (world ranks 3)": `path` is the
// group's number among its parent's splits after its parent's path.
std::string group_text(const std::string& path, std::span<const int> members) {
  return path.empty() ? std::string("the world")
                      : fmt::format("group {} (world ranks {})", path, format_ranks(members));
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

// A split's answer to one rank: the new group's number among the parent's splits, where
// its rank 0 listens (host, port), and its members (world ranks, in its rank order).
struct NewGroup {
  uint32_t number = 0;
  std::string host;
  int port = 0;
  std::vector<int> members;
};

std::vector<uint8_t> encode_new_group(const NewGroup& g) {
  std::vector<uint8_t> out;
  put(out, g.number, 4);
  put(out, static_cast<uint32_t>(g.port), 4);
  put(out, g.host.size(), 4);
  out.insert(out.end(), g.host.begin(), g.host.end());
  put(out, g.members.size(), 4);
  for (int m : g.members) put(out, static_cast<uint32_t>(m), 4);
  return out;
}

NewGroup decode_new_group(const std::vector<uint8_t>& bytes) {
  FORGE_CHECK(bytes.size() >= 16, "split answer of {} bytes", bytes.size());
  const uint8_t* p = bytes.data();
  NewGroup g;
  g.number = static_cast<uint32_t>(get(p, 4));
  g.port = static_cast<int>(get(p, 4));
  const auto host = static_cast<size_t>(get(p, 4));
  FORGE_CHECK(bytes.size() >= 16 + host, "split answer of {} bytes for a host of {}", bytes.size(), host);
  g.host.assign(reinterpret_cast<const char*>(p), host);
  p += host;
  const auto count = static_cast<size_t>(get(p, 4));
  FORGE_CHECK(bytes.size() == 16 + host + 4 * count, "split answer of {} bytes for {} ranks", bytes.size(), count);
  g.members.resize(count);
  for (int& m : g.members) m = static_cast<int>(get(p, 4));
  return g;
}

// What the groups of one world share on this rank: the options, the heartbeat, and the
// failure that ends every later call on any of them. Lives as long as any of its groups.
struct World {
  World(int rank, int size, const ProcessGroupOptions& options) : rank(rank), size(size), options(options) {}

  // The first failure of any group on this rank (empty while none failed).
  std::string failure() {
    std::lock_guard lock(mu);
    return failure_;
  }
  void fail(const std::string& message) {
    std::lock_guard lock(mu);
    if (failure_.empty()) failure_ = message;
  }

  const int rank;  // in the world
  const int size;
  const ProcessGroupOptions options;
  std::unique_ptr<Heartbeat> heartbeat;  // NOTE [Failure detection]

 private:
  std::mutex mu;
  std::string failure_;
};

class CpuProcessGroup final : public ProcessGroup {
 public:
  // `members`: the world ranks of `store`'s ranks, in order; `path` as group_text's.
  CpuProcessGroup(std::shared_ptr<World> world, std::unique_ptr<TcpStore> store, std::string path,
                  std::vector<int> members)
      : world_(std::move(world)),
        store_(std::move(store)),
        path_(std::move(path)),
        members_(std::move(members)),
        name_(group_text(path_, members_)),
        rank_(store_->rank()) {
    FORGE_CHECK(store_->world_size() == world_size() && members_[rank_] == world_->rank,
                "rank {} of {} is not rank {} of {}", world_->rank, name_, rank_, world_size());
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

  // A round of the parent answers each rank with its new group: its members and where its
  // rank 0 listens (every rank listens before the round, as any may become one); then the
  // new group meets over its own connections (NOTE [CPU process group]).
  std::unique_ptr<ProcessGroup> split(int color, int key) override {
    check_open("split");
    check_split(color);
    Call call;
    call.kind = Kind::Split;
    call.color = color;
    call.key = key;
    std::unique_ptr<ProcessGroup> group;
    round(call, [&](const std::string& stage) {
      World& w = *world_;
      net::Fd listener = world_size() > 1 ? net::listen_tcp(0) : net::Fd();
      std::vector<uint8_t> port;
      put(port, listener.valid() ? static_cast<uint64_t>(net::bound_port(listener)) : 0, kCountBytes);
      std::vector<uint8_t> answer;
      if (rank_ == 0) {
        answer = serve(call, {}, {}, stage, port);
      } else {
        std::vector<uint8_t> head = encode(call);
        head.insert(head.end(), port.begin(), port.end());
        store_->send_to_root(head, {}, w.options.collective_timeout, stage);
        answer = store_->receive_from_root(w.options.collective_timeout, stage);
      }
      NewGroup g = decode_new_group(answer);
      const auto me = std::find(g.members.begin(), g.members.end(), w.rank);
      FORGE_CHECK(me != g.members.end(), "{}: rank {} is not in its new group", stage, w.rank);
      const int rank = static_cast<int>(me - g.members.begin());
      if (rank != 0) listener = net::Fd();
      const std::string path = path_.empty() ? fmt::format("{}", g.number) : fmt::format("{}.{}", path_, g.number);
      std::unique_ptr<TcpStore> store;
      try {
        store = std::make_unique<TcpStore>(rank, static_cast<int>(g.members.size()), std::move(listener), g.host,
                                           g.port, g.members, w.options.collective_timeout);
      } catch (const Error& e) {
        FORGE_FAIL("{}: meeting the new group {}: {}", stage, group_text(path, g.members), e.what());
      }
      group = std::make_unique<CpuProcessGroup>(world_, std::move(store), path, std::move(g.members));
    });
    return group;
  }

  // Nothing is in flight between calls; the group's connections close here, after the
  // heartbeat when this was the world's last group.
  void destroy() override {
    world_.reset();
    store_.reset();
  }

 private:
  void check_open(const char* what) const {
    FORGE_CHECK(world_ != nullptr, "{} on a process group after destroy()", what);
  }

  // Runs one round of `call` on this group: `body` does the talking, under the group's
  // lock; a failure is recorded for every group of this rank, reported, and thrown.
  template <typename Body>
  void round(Call& call, Body&& body) {
    World& w = *world_;
    std::lock_guard lock(mu_);
    if (const std::string failure = w.failure(); !failure.empty()) throw Error(failure);
    call.number = ++calls_;
    const std::string stage = fmt::format("{} on {}", call_text(call), name_);
    const uint64_t record = flight_record_start(name_, call_text(call));
    try {
      body(stage);
    } catch (const Error& e) {
      const std::string failure = fmt::format("rank {} of {}: {}", w.rank, w.size, e.what());
      w.fail(failure);
      const int culprit = rank_ == 0 ? store_->culprit() : -1;
      if (w.heartbeat) w.heartbeat->fail(failure, culprit >= 0 ? members_[culprit] : -1);
      if (w.options.on_failure) w.options.on_failure(failure);
      throw Error(failure);
    }
    flight_record_end(record);
  }

  // A collective: `input` goes to rank 0, this rank's result comes back into `output`.
  // `counts`: an all_to_all's send and receive counts, or a send_recv's op words, sent
  // between the call and `input`.
  void run(Call& call, std::span<const uint8_t> input, std::span<uint8_t> output,
           std::span<const uint8_t> counts = {}) {
    round(call, [&](const std::string& stage) {
      const std::chrono::milliseconds timeout = world_->options.collective_timeout;
      if (rank_ == 0) {
        serve(call, input, output, stage, counts);
        return;
      }
      std::vector<uint8_t> head = encode(call);
      head.insert(head.end(), counts.begin(), counts.end());
      store_->send_to_root(head, input, timeout, stage);
      store_->receive_from_root(output, timeout, stage);
    });
  }

  // Rank 0's side of a round (its own call is `mine`, `my_counts` those of its all_to_all,
  // its send_recv or its split): gathers the other ranks' calls, checks them, and answers
  // each. Returns rank 0's answer to a split.
  std::vector<uint8_t> serve(const Call& mine, std::span<const uint8_t> input, std::span<uint8_t> output,
                             const std::string& stage, std::span<const uint8_t> my_counts = {}) {
    const std::chrono::milliseconds timeout = world_->options.collective_timeout;
    const size_t n = members_.size();
    std::vector<std::vector<uint8_t>> messages = store_->gather_at_root(timeout, stage);
    std::vector<Call> calls(n);
    std::vector<std::span<const uint8_t>> inputs(n);
    // all_to_all: send, then receive counts; send_recv: op words; split: the port
    std::vector<std::vector<int64_t>> counts(n);
    calls[0] = mine;
    inputs[0] = input;
    counts[0] = decode_counts(my_counts);
    for (size_t k = 1; k < n; ++k) {
      if (messages[k].size() < kCallBytes)
        store_->abort(fmt::format("{}: rank {} sent a malformed call", stage, members_[k]));
      calls[k] = decode(messages[k].data());
      inputs[k] = std::span<const uint8_t>(messages[k]).subspan(kCallBytes);
    }
    SendRecvRound send_recv;
    check_calls(calls, inputs, counts, send_recv);

    std::vector<uint8_t> own_answer;
    const auto deliver = [&](size_t k, std::span<const uint8_t> bytes) {
      if (k != 0) {
        store_->send_to(static_cast<int>(k), bytes, timeout, stage);
      } else if (!bytes.empty()) {
        std::memcpy(output.data(), bytes.data(), bytes.size());
      }
    };
    const Call& call = calls[0];
    switch (call.kind) {
      case Kind::AllReduce:
      case Kind::ReduceScatter: {
        const std::vector<uint8_t> result = reduce(inputs, call.input, call.dtype, call.op);
        const size_t chunk = call.output * dtype_size(call.dtype);
        for (size_t k = 0; k < n; ++k) {
          const std::span<const uint8_t> all(result);
          deliver(k, call.kind == Kind::AllReduce ? all : all.subspan(k * chunk, chunk));
        }
        break;
      }
      case Kind::AllGather: {
        std::vector<uint8_t> result(call.output * dtype_size(call.dtype));
        const size_t chunk = call.input * dtype_size(call.dtype);
        for (size_t k = 0; k < n; ++k)
          if (chunk > 0) std::memcpy(result.data() + k * chunk, inputs[k].data(), chunk);
        for (size_t k = 0; k < n; ++k) deliver(k, result);
        break;
      }
      case Kind::Barrier:
        for (size_t k = 0; k < n; ++k) deliver(k, {});
        break;
      case Kind::AllToAll: {
        // Rank j gets, from each rank i in order, i's rows for j.
        const size_t row_bytes = call.row * dtype_size(call.dtype);
        for (size_t j = 0; j < n; ++j) {
          std::vector<uint8_t> result(calls[j].output * dtype_size(call.dtype));
          size_t at = 0;
          for (size_t i = 0; i < n; ++i) {
            const std::vector<int64_t>& send = counts[i];
            int64_t offset = 0;
            for (size_t k = 0; k < j; ++k) offset += send[k];
            const size_t bytes = static_cast<size_t>(send[j]) * row_bytes;
            if (bytes > 0)
              std::memcpy(result.data() + at, inputs[i].data() + static_cast<size_t>(offset) * row_bytes, bytes);
            at += bytes;
          }
          deliver(j, result);
        }
        break;
      }
      case Kind::SendRecv: {
        // Each rank's receives, in its op order, filled from the sends paired with them.
        std::vector<std::vector<uint8_t>> results(n);
        std::vector<std::vector<uint64_t>> offsets(n);
        for (size_t k = 0; k < n; ++k) {
          results[k].resize(calls[k].output);
          offsets[k] = payload_offsets(send_recv.ops[k]);
        }
        for (const PointToPointTransfer& t : send_recv.transfers)
          if (t.bytes > 0)
            std::memcpy(results[t.to].data() + offsets[t.to][t.recv], inputs[t.from].data() + offsets[t.from][t.send],
                        t.bytes);
        for (size_t k = 0; k < n; ++k) deliver(k, results[k]);
        break;
      }
      case Kind::Split: {
        std::vector<std::vector<uint8_t>> answers = split_answers(calls, counts);
        for (size_t k = 1; k < n; ++k) deliver(k, answers[k]);
        own_answer = std::move(answers[0]);
        break;
      }
    }
    return own_answer;
  }

  // Rank 0: checks that every rank of the group made the same call, and that each input
  // has the size its call says. An all_to_all's counts (a send_recv's op words, a split's
  // port) are split off the front of the other ranks' inputs into `counts` (rank 0's are
  // there already), and checked against the receivers'; a send_recv's pairing goes into
  // `send_recv`. Messages name world ranks.
  void check_calls(const std::vector<Call>& calls, std::vector<std::span<const uint8_t>>& inputs,
                   std::vector<std::vector<int64_t>>& counts, SendRecvRound& send_recv) {
    const size_t n = members_.size();
    std::vector<std::string> texts(n);
    for (size_t k = 0; k < n; ++k) texts[k] = fmt::format("{} on {}", call_text(calls[k]), name_);
    if (std::any_of(texts.begin(), texts.end(), [&](const std::string& t) { return t != texts[0]; })) {
      std::vector<std::pair<std::string, std::vector<int>>> by_call;  // in order of first rank
      for (size_t k = 0; k < n; ++k) {
        auto same = std::find_if(by_call.begin(), by_call.end(), [&](const auto& c) { return c.first == texts[k]; });
        if (same == by_call.end()) {
          by_call.push_back({texts[k], {members_[k]}});
        } else {
          same->second.push_back(members_[k]);
        }
      }
      std::string list;
      for (const auto& [text, ranks] : by_call)
        list += fmt::format("{}{} {} called {}", list.empty() ? "" : "; ", ranks.size() > 1 ? "ranks" : "rank",
                            format_ranks(ranks), text);
      store_->abort(fmt::format(
          "collectives do not match across ranks: {} (every rank of a group must make the same calls on it in the "
          "same order; ranks are world ranks)",
          list));
    }
    const Kind kind = calls[0].kind;
    for (size_t k = 1; k < n; ++k) {
      const uint64_t count_bytes = kind == Kind::AllToAll   ? 2 * kCountBytes * n
                                   : kind == Kind::SendRecv ? kOpWords * kCountBytes * calls[k].ops
                                   : kind == Kind::Split    ? kCountBytes
                                                            : 0;
      const uint64_t expected = count_bytes + calls[k].input * dtype_size(calls[k].dtype);
      if (inputs[k].size() != expected)
        store_->abort(
            fmt::format("{}: rank {} sent {} bytes, which needs {}", texts[k], members_[k], inputs[k].size(), expected));
      counts[k] = decode_counts(inputs[k].first(count_bytes));
      inputs[k] = inputs[k].subspan(count_bytes);
    }
    if (kind == Kind::SendRecv) send_recv = pair_send_recv(calls, counts, texts[0]);
    if (kind != Kind::AllToAll) return;
    for (size_t k = 0; k < n; ++k) {
      const std::vector<int64_t>& mine = counts[k];
      bool valid = mine.size() == 2 * n;
      uint64_t sent = 0;
      uint64_t received = 0;
      for (size_t j = 0; valid && j < n; ++j) {
        valid = mine[j] >= 0 && mine[n + j] >= 0;
        sent += static_cast<uint64_t>(mine[j]);
        received += static_cast<uint64_t>(mine[n + j]);
      }
      if (!valid || sent * calls[k].row != calls[k].input || received * calls[k].row != calls[k].output)
        store_->abort(fmt::format("{}: rank {} sent row counts that do not add up to its rows", texts[k], members_[k]));
    }
    std::vector<std::string> mismatches;
    for (size_t i = 0; i < n; ++i) {
      for (size_t j = 0; j < n; ++j) {
        const int64_t expects = counts[j][n + i];
        if (counts[i][j] != expects)
          mismatches.push_back(fmt::format("rank {} sends {} rows to rank {}, which expects {} from it", members_[i],
                                           counts[i][j], members_[j], expects));
      }
    }
    if (!mismatches.empty())
      store_->abort(fmt::format(
          "{}: the ranks' row counts do not match (every rank's send_counts[j] must equal rank j's "
          "recv_counts[its rank]; ranks are world ranks): {}",
          texts[0], first_lines(std::move(mismatches))));
  }

  // Rank 0: the ops of a send_recv's ranks from their op words, checked against their
  // calls' byte counts, and paired across the group; a mismatch fails the round.
  SendRecvRound pair_send_recv(const std::vector<Call>& calls, const std::vector<std::vector<int64_t>>& counts,
                               const std::string& text) {
    const size_t n = members_.size();
    SendRecvRound sr;
    for (size_t k = 0; k < n; ++k) {
      const std::vector<int64_t>& words = counts[k];
      std::vector<PointToPointShape>& ops = sr.ops.emplace_back();
      bool valid = words.size() == kOpWords * calls[k].ops;
      uint64_t sent = 0;
      uint64_t received = 0;
      for (size_t i = 0; valid && i < calls[k].ops; ++i) {
        const int64_t kind = words[kOpWords * i];
        const int64_t peer = words[kOpWords * i + 1];
        const auto bytes = static_cast<uint64_t>(words[kOpWords * i + 2]);
        valid = (kind == 0 || kind == 1) && peer >= 0 && peer < static_cast<int64_t>(n);
        ops.push_back({kind == 0 ? PointToPoint::Kind::Send : PointToPoint::Kind::Recv, static_cast<int>(peer), bytes});
        (kind == 0 ? sent : received) += bytes;
      }
      if (!valid || sent != calls[k].input || received != calls[k].output)
        store_->abort(fmt::format("{}: rank {} sent ops that do not add up to its bytes", text, members_[k]));
    }
    PointToPointPairing pairing = pair_point_to_point(sr.ops, members_);
    if (!pairing.mismatches.empty())
      store_->abort(fmt::format(
          "{}: the ranks' sends and receives do not pair up (rank a's k-th send to rank b must be received by rank "
          "b's k-th receive from rank a, of as many bytes; ops are numbered in each rank's list, ranks are world "
          "ranks): {}",
          text, first_lines(std::move(pairing.mismatches))));
    sr.transfers = std::move(pairing.transfers);
    return sr;
  }

  // Rank 0: splits the group by the colors and keys of the calls and returns each rank's
  // answer: its new group, numbered in color order, and where the group's rank 0 (its
  // smallest key, ties broken by rank here) listens: the port it sent in `counts`, at the
  // host this rank's connection from it comes from (or that the others reach this rank at).
  std::vector<std::vector<uint8_t>> split_answers(const std::vector<Call>& calls,
                                                  const std::vector<std::vector<int64_t>>& counts) {
    std::map<int32_t, std::vector<std::pair<int32_t, size_t>>> by_color;  // color -> (key, rank in group)
    for (size_t k = 0; k < members_.size(); ++k) by_color[calls[k].color].push_back({calls[k].key, k});
    std::vector<std::vector<uint8_t>> answers(members_.size());
    for (auto& [color, entries] : by_color) {
      std::sort(entries.begin(), entries.end());
      NewGroup g;
      g.number = next_split_++;
      for (const auto& entry : entries) g.members.push_back(members_[entry.second]);
      const size_t root = entries[0].second;
      if (entries.size() > 1) {
        g.host = root == 0 ? store_->root_host() : store_->peer_host(static_cast<int>(root));
        g.port = static_cast<int>(counts[root].at(0));
      }
      const std::vector<uint8_t> answer = encode_new_group(g);
      for (const auto& entry : entries) answers[entry.second] = answer;
    }
    return answers;
  }

  std::shared_ptr<World> world_;     // null once destroyed
  std::unique_ptr<TcpStore> store_;  // this group's star; null once destroyed
  std::mutex mu_;                    // one round at a time on this group
  std::string path_;                 // as group_text's; empty for the world
  std::vector<int> members_;         // world ranks, in this group's rank order
  std::string name_;                 // "the world", "group 2 (world ranks 1, 3)"
  int rank_ = 0;
  uint64_t calls_ = 0;
  uint32_t next_split_ = 1;  // rank 0: the number of the next group its splits make
};

}  // namespace

std::unique_ptr<ProcessGroup> create_cpu_process_group(const LaunchEnv& env, const ProcessGroupOptions& options) {
  FORGE_CHECK(options.device == Device::CPU, "the CPU process group on {}", device_name(options.device));
  auto world = std::make_shared<World>(env.rank, env.world_size, options);
  auto store = std::make_unique<TcpStore>(env, options.rendezvous_timeout);
  if (options.heartbeat_timeout.count() > 0)
    world->heartbeat =
        std::make_unique<Heartbeat>(*store, env, HeartbeatOptions{options.heartbeat_timeout, options.rendezvous_timeout, {}});
  std::vector<int> everyone(env.world_size);
  std::iota(everyone.begin(), everyone.end(), 0);
  return std::make_unique<CpuProcessGroup>(std::move(world), std::move(store), "", std::move(everyone));
}

}  // namespace forge
