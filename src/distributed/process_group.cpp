#include "distributed/process_group.h"

#include <cstring>
#include <tuple>
#include <utility>

#include "core/error.h"
#include "distributed/cpu_process_group.h"
#include "distributed/point_to_point.h"

#ifdef FORGE_CUDA
#include "distributed/cuda/nccl_process_group.h"
#endif

namespace forge {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return "sum";
    case ReduceOp::Avg: return "avg";
    case ReduceOp::Max: return "max";
  }
  return "an unknown reduction";
}

namespace {

// The one-rank group on the CPU (NOTE [Process group]): a sum or mean over one rank is
// the tensor itself, and one rank's chunk is the whole buffer.
class SingleRankGroup final : public ProcessGroup {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

  void all_reduce(const Tensor& tensor, ReduceOp, CudaStream) override {
    check_open();
    check_all_reduce(tensor, Device::CPU);
  }
  void reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp, CudaStream) override {
    check_open();
    check_reduce_scatter(output, input, 1, Device::CPU);
    if (output.raw() != input.raw()) output.copy_from(input);
  }
  void all_gather(const Tensor& output, const Tensor& input, CudaStream) override {
    check_open();
    check_all_gather(output, input, 1, Device::CPU);
    if (output.raw() != input.raw()) output.copy_from(input);
  }
  // Counts [n] and [n]: the first n rows of `input` into the first n rows of `output`.
  void all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                  const std::vector<int64_t>& send_counts, CudaStream) override {
    check_open();
    check_all_to_all(output, recv_counts, input, send_counts, 1, Device::CPU);
    FORGE_CHECK(send_counts[0] == recv_counts[0],
                "all_to_all: rank 0 sends {} rows to rank 0 (itself), which expects {} from it", send_counts[0],
                recv_counts[0]);
    const size_t bytes = static_cast<size_t>(send_counts[0] * row_elements(input)) * dtype_size(input.dtype());
    if (bytes > 0) std::memcpy(output.raw(), input.raw(), bytes);
  }
  // Only sends to itself, each received by the matching receive from itself: copies.
  void send_recv(const std::vector<PointToPoint>& ops, CudaStream) override {
    check_open();
    check_send_recv(ops, 1, Device::CPU);
    for (const PointToPointTransfer& t : check_send_recv_to_self(ops, 0))
      if (t.bytes > 0) std::memcpy(ops[t.recv].tensor.raw(), ops[t.send].tensor.raw(), t.bytes);
  }
  void barrier() override { check_open(); }
  void destroy() override { destroyed_ = true; }
  // The only rank forms a group of one whatever its color and key.
  std::unique_ptr<ProcessGroup> split(int color, int) override {
    check_open();
    check_split(color);
    return std::make_unique<SingleRankGroup>();
  }

 private:
  void check_open() const { FORGE_CHECK(!destroyed_, "process group used after destroy()"); }
  bool destroyed_ = false;
};

// bytes: U8 is accepted too (an all-gather moves FP8 codes: NOTE [FP8 all-gather] in distributed/fsdp.h).
void check_tensor(const Tensor& t, Device device, const char* collective, const char* what, bool bytes = false) {
  FORGE_CHECK(t.defined(), "{}: {} is undefined", collective, what);
  FORGE_CHECK(t.device() == device, "{}: {} is on {}, the process group on {}", collective, what,
              device_name(t.device()), device_name(device));
  FORGE_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16 || (bytes && t.dtype() == DType::U8),
              "{}: {} is {}, expected f32 or bf16{}", collective, what, dtype_name(t.dtype()), bytes ? " or u8" : "");
}

}  // namespace

void check_all_reduce(const Tensor& tensor, Device device) { check_tensor(tensor, device, "all_reduce", "tensor"); }

void check_reduce_scatter(const Tensor& output, const Tensor& input, int world_size, Device device) {
  check_tensor(output, device, "reduce_scatter", "output");
  check_tensor(input, device, "reduce_scatter", "input");
  FORGE_CHECK(output.dtype() == input.dtype(), "reduce_scatter: output is {}, input {}", dtype_name(output.dtype()),
              dtype_name(input.dtype()));
  FORGE_CHECK(input.numel() == output.numel() * world_size,
              "reduce_scatter: input {} must hold world size {} chunks of output {}", shape_str(input.shape()),
              world_size, shape_str(output.shape()));
}

void check_all_gather(const Tensor& output, const Tensor& input, int world_size, Device device) {
  check_tensor(output, device, "all_gather", "output", /*bytes=*/true);
  check_tensor(input, device, "all_gather", "input", /*bytes=*/true);
  FORGE_CHECK(output.dtype() == input.dtype(), "all_gather: output is {}, input {}", dtype_name(output.dtype()),
              dtype_name(input.dtype()));
  FORGE_CHECK(output.numel() == input.numel() * world_size,
              "all_gather: output {} must hold world size {} chunks of input {}", shape_str(output.shape()), world_size,
              shape_str(input.shape()));
}

int64_t row_elements(const Tensor& t) {
  int64_t n = 1;
  for (int i = 1; i < t.ndim(); ++i) n *= t.dim(i);
  return n;
}

void check_all_to_all(const Tensor& output, const std::vector<int64_t>& recv_counts, const Tensor& input,
                      const std::vector<int64_t>& send_counts, int world_size, Device device) {
  for (const auto& [t, what] : {std::pair{&output, "output"}, std::pair{&input, "input"}}) {
    FORGE_CHECK(t->defined(), "all_to_all: {} is undefined", what);
    FORGE_CHECK(t->device() == device, "all_to_all: {} is on {}, the process group on {}", what,
                device_name(t->device()), device_name(device));
    FORGE_CHECK(t->ndim() >= 1, "all_to_all: {} is a scalar, expected rows along dim 0", what);
  }
  FORGE_CHECK(output.dtype() == input.dtype(), "all_to_all: output is {}, input {}", dtype_name(output.dtype()),
              dtype_name(input.dtype()));
  FORGE_CHECK(row_elements(output) == row_elements(input),
              "all_to_all: output {} has rows of {} elements, input {} of {}: both must be the same", shape_str(output.shape()),
              row_elements(output), shape_str(input.shape()), row_elements(input));
  for (const auto& [counts, what, t] : {std::tuple{&send_counts, "send_counts", &input},
                                        std::tuple{&recv_counts, "recv_counts", &output}}) {
    FORGE_CHECK(counts->size() == static_cast<size_t>(world_size),
                "all_to_all: {} has {} entries, expected one per rank of the group ({})", what, counts->size(),
                world_size);
    int64_t sum = 0;
    for (size_t r = 0; r < counts->size(); ++r) {
      FORGE_CHECK((*counts)[r] >= 0, "all_to_all: {}[{}] is {}, expected a row count >= 0", what, r, (*counts)[r]);
      sum += (*counts)[r];
    }
    FORGE_CHECK(sum <= t->dim(0), "all_to_all: {} add up to {} rows, but {} {} has {}", what, sum,
                t == &input ? "input" : "output", shape_str(t->shape()), t->dim(0));
  }
  const auto* out = static_cast<const uint8_t*>(output.raw());
  const auto* in = static_cast<const uint8_t*>(input.raw());
  FORGE_CHECK(output.nbytes() == 0 || input.nbytes() == 0 || out + output.nbytes() <= in ||
                  in + input.nbytes() <= out,
              "all_to_all: output and input overlap (it does not work in place)");
}

void check_send_recv(const std::vector<PointToPoint>& ops, int world_size, Device device) {
  const auto describe_op = [&](size_t i) {
    const PointToPoint& op = ops[i];
    return fmt::format("op {} ({} rank {})", i, op.kind == PointToPoint::Kind::Send ? "send to" : "receive from",
                       op.peer);
  };
  for (size_t i = 0; i < ops.size(); ++i) {
    const PointToPoint& op = ops[i];
    FORGE_CHECK(op.kind == PointToPoint::Kind::Send || op.kind == PointToPoint::Kind::Recv,
                "send_recv: op {} is neither a send nor a receive", i);
    FORGE_CHECK(op.peer >= 0 && op.peer < world_size, "send_recv: {} names a rank outside the group of {} (0..{})",
                describe_op(i), world_size, world_size - 1);
    FORGE_CHECK(op.tensor.defined(), "send_recv: {}: its tensor is undefined", describe_op(i));
    FORGE_CHECK(op.tensor.device() == device, "send_recv: {}: its tensor is on {}, the process group on {}",
                describe_op(i), device_name(op.tensor.device()), device_name(device));
  }
  // A receive writes its tensor while the call's other ops read or write theirs.
  for (size_t i = 0; i < ops.size(); ++i) {
    if (ops[i].kind != PointToPoint::Kind::Recv || ops[i].tensor.nbytes() == 0) continue;
    const auto* mine = static_cast<const uint8_t*>(ops[i].tensor.raw());
    for (size_t j = 0; j < ops.size(); ++j) {
      if (j == i || ops[j].tensor.nbytes() == 0) continue;
      const auto* other = static_cast<const uint8_t*>(ops[j].tensor.raw());
      FORGE_CHECK(mine + ops[i].tensor.nbytes() <= other || other + ops[j].tensor.nbytes() <= mine,
                  "send_recv: {} receives into memory that {} {} (a receive's tensor must not overlap any other "
                  "op's tensor)",
                  describe_op(i), describe_op(j),
                  ops[j].kind == PointToPoint::Kind::Send ? "sends from" : "receives into too");
    }
  }
}

void check_split(int color) {
  FORGE_CHECK(color >= 0, "split: color {} is negative (every rank must belong to a group)", color);
}

std::unique_ptr<ProcessGroup> create_process_group(const LaunchEnv& env, const ProcessGroupOptions& options) {
  if (options.device == Device::CUDA) {
#ifdef FORGE_CUDA
    return std::make_unique<NcclProcessGroup>(env, options);
#else
    FORGE_FAIL("{}: multi-GPU communication needs the CUDA backend (configure with -DFORGE_CUDA=ON)", describe(env));
#endif
  }
  if (env.world_size > 1) return create_cpu_process_group(env, options);
  return std::make_unique<SingleRankGroup>();
}

}  // namespace forge
