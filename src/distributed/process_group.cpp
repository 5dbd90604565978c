#include "distributed/process_group.h"

#include "core/error.h"
#include "distributed/cpu_process_group.h"

#ifdef FORGE_CUDA
#include "distributed/cuda/nccl_process_group.h"
#endif

namespace forge {
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

void check_tensor(const Tensor& t, Device device, const char* collective, const char* what) {
  FORGE_CHECK(t.defined(), "{}: {} is undefined", collective, what);
  FORGE_CHECK(t.device() == device, "{}: {} is on {}, the process group on {}", collective, what,
              device_name(t.device()), device_name(device));
  FORGE_CHECK(t.dtype() == DType::F32 || t.dtype() == DType::BF16, "{}: {} is {}, expected f32 or bf16", collective,
              what, dtype_name(t.dtype()));
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
  check_tensor(output, device, "all_gather", "output");
  check_tensor(input, device, "all_gather", "input");
  FORGE_CHECK(output.dtype() == input.dtype(), "all_gather: output is {}, input {}", dtype_name(output.dtype()),
              dtype_name(input.dtype()));
  FORGE_CHECK(output.numel() == input.numel() * world_size,
              "all_gather: output {} must hold world size {} chunks of input {}", shape_str(output.shape()), world_size,
              shape_str(input.shape()));
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
