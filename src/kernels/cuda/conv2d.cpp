// Convolution of NHWC bf16 activations on the GPU through cuDNN: a cudnn-frontend graph of
// one conv_fprop node (fp32 accumulation), built once per problem and cached, as the
// attention graphs are (kernels/cuda/attention.cpp).
//
// cuDNN describes every tensor as (N, C, H, W) dims with strides that give the layout:
//   X  dims (B, I, H, W)   strides (H W I, 1, W I, I)       NHWC
//   W  dims (O, I, K, K)   strides (K K I, 1, K I, I)       KRSC ([O, K, K, I] in memory)
//   Y  dims (B, O, Ho, Wo) strides (Ho Wo O, 1, Wo O, O)    NHWC
// Padding is symmetric here; the dispatcher pads an input explicitly for the asymmetric
// downsample (NOTE [VAE downsample padding] in ops/conv2d.cpp). The bias is not a node of the
// graph: the dispatcher adds it afterwards (kernels/cuda/bias.h), so the graph is a plain
// convolution, the form with the widest engine support (the image has 3 channels, the
// decoder's output 3: not the multiples of 8 the tensor-core engines want). Plans come from
// heuristics mode A, then cuDNN's fallback list, whose engines take any channel count.
//
// Building a graph takes milliseconds to tens of milliseconds; the VAE runs a few dozen
// distinct problems per image size.
#include "kernels/cuda/conv2d.h"

#include <cudnn.h>
#include <cudnn_frontend.h>

#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "core/device.h"
#include "kernels/cuda/cuda_check.h"

namespace forge::cuda {
namespace {

namespace fe = cudnn_frontend;

enum Uid : int64_t { kX = 1, kW, kY };

void check_fe(fe::error_t status, const char* what, const Conv2dProblem& p) {
  if (status.is_bad())
    FORGE_FAIL("cuDNN convolution ({}x{}x{}x{} -> {} channels, kernel {}, stride {}, pad {}): {} failed: {}", p.batch,
               p.height, p.width, p.in_channels, p.out_channels, p.kernel, p.stride, p.pad, what,
               status.get_message());
}

struct CachedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  int64_t workspace_bytes = 0;
};

using ProblemKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t>;

struct Context {
  cudnnHandle_t handle = nullptr;
  std::map<ProblemKey, CachedGraph> graphs;
  void* workspace = nullptr;
  int64_t workspace_bytes = 0;
  std::mutex mu;

  Context() {
    cudnnStatus_t s = cudnnCreate(&handle);
    if (s != CUDNN_STATUS_SUCCESS) FORGE_FAIL("cudnnCreate failed: {}", cudnnGetErrorString(s));
  }

  void* workspace_of(int64_t bytes) {
    if (bytes > workspace_bytes) {
      device_synchronize();
      device_free(workspace);
      workspace = device_malloc(static_cast<size_t>(bytes));
      workspace_bytes = bytes;
    }
    return workspace;
  }
};

Context& context() {
  static Context* ctx = new Context();  // lives for the process, like the attention context
  return *ctx;
}

int64_t out_size(int64_t in, const Conv2dProblem& p) { return (in + 2 * p.pad - p.kernel) / p.stride + 1; }

CachedGraph build(Context& ctx, const Conv2dProblem& p) {
  const int64_t ho = out_size(p.height, p), wo = out_size(p.width, p);
  auto g = std::make_shared<fe::graph::Graph>();
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto x = g->tensor(fe::graph::Tensor_attributes()
                         .set_name("X")
                         .set_uid(kX)
                         .set_dim({p.batch, p.in_channels, p.height, p.width})
                         .set_stride({p.height * p.width * p.in_channels, 1, p.width * p.in_channels, p.in_channels}));
  const int64_t kernel_row = p.kernel * p.in_channels;  // one row of a filter: K pixels of I channels
  auto w = g->tensor(fe::graph::Tensor_attributes()
                         .set_name("W")
                         .set_uid(kW)
                         .set_dim({p.out_channels, p.in_channels, p.kernel, p.kernel})
                         .set_stride({p.kernel * kernel_row, 1, kernel_row, p.in_channels}));
  auto attributes = fe::graph::Conv_fprop_attributes()
                        .set_name("conv2d_forward")
                        .set_compute_data_type(fe::DataType_t::FLOAT)
                        .set_padding({p.pad, p.pad})
                        .set_stride({p.stride, p.stride})
                        .set_dilation({1, 1});
  auto y = g->conv_fprop(x, w, attributes);
  y->set_output(true)
      .set_uid(kY)
      .set_data_type(fe::DataType_t::BFLOAT16)
      .set_dim({p.batch, p.out_channels, ho, wo})
      .set_stride({ho * wo * p.out_channels, 1, wo * p.out_channels, p.out_channels});
  check_fe(g->validate(), "validate", p);
  check_fe(g->build_operation_graph(ctx.handle), "build_operation_graph", p);
  check_fe(g->create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}), "create_execution_plans", p);
  check_fe(g->check_support(ctx.handle), "check_support", p);
  check_fe(g->build_plans(ctx.handle), "build_plans", p);
  CachedGraph cached{g, 0};
  check_fe(g->get_workspace_size(cached.workspace_bytes), "get_workspace_size", p);
  return cached;
}

}  // namespace

void conv2d_forward(bf16* out, const bf16* in, const bf16* weight, const Conv2dProblem& p) {
  Context& ctx = context();
  std::lock_guard lock(ctx.mu);
  const ProblemKey key{p.batch, p.height, p.width, p.in_channels, p.out_channels, p.kernel, p.stride, p.pad};
  auto it = ctx.graphs.find(key);
  if (it == ctx.graphs.end()) it = ctx.graphs.emplace(key, build(ctx, p)).first;
  std::unordered_map<int64_t, void*> pack = {{kX, const_cast<bf16*>(in)}, {kW, const_cast<bf16*>(weight)}, {kY, out}};
  void* workspace = ctx.workspace_of(it->second.workspace_bytes);
  check_fe(it->second.graph->execute(ctx.handle, pack, workspace), "execute", p);
}

}  // namespace forge::cuda
