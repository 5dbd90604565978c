#include "distributed/tensor_parallel_gather.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "model/parameters.h"

namespace forge {
namespace {

// A shard's run placed in the whole model: local elements [local, local + count) of a
// rank's index space are the whole model's [whole, whole + count).
struct PlacedRun {
  int64_t local = 0, whole = 0, count = 0;
};

// The runs of tensor-parallel rank `shard`'s shards that it places, in local order: all but
// the replicated parameters', which rank 0 places.
std::vector<PlacedRun> placed_runs(const std::vector<ParamSpec>& specs, TensorParallelShard shard) {
  std::vector<PlacedRun> out;
  int64_t local = 0, whole = 0;
  for (const ParamSpec& spec : specs) {
    if (shard.rank == 0 || spec.tensor_parallel != TensorParallelSplit::Replicated)
      for (const ShardRun& run : tensor_parallel_runs(spec, shard))
        out.push_back({local + run.local_begin, whole + run.full_begin, run.count});
    local += shape_numel(tensor_parallel_spec(spec, shard).shape);
    whole += shape_numel(spec.shape);
  }
  return out;
}

}  // namespace

void gather_tensor_parallel_shards(ProcessGroup& group, Device device, const ModelConfig& config,
                                   std::span<const float> local, std::span<float> whole) {
  const int size = group.world_size();
  const std::vector<ParamSpec> specs = parameter_specs(config);
  int64_t n = 0;
  for (const ParamSpec& spec : parameter_specs(config, {group.rank(), size})) n += shape_numel(spec.shape);
  FORGE_CHECK(local.empty() || static_cast<int64_t>(local.size()) == n,
              "tensor-parallel rank {} of {} passes {} values of its {}", group.rank(), size, local.size(), n);
  const bool root = group.rank() == 0 && !whole.empty();
  if (root) FORGE_CHECK(static_cast<int64_t>(whole.size()) == config.total_params(), "{} values for a model of {}",
                        whole.size(), config.total_params());
  std::vector<std::vector<PlacedRun>> runs;
  if (root)
    for (int r = 0; r < size; ++r) runs.push_back(placed_runs(specs, {r, size}));
  constexpr int64_t kSlice = int64_t{1} << 24;
  const int64_t slice = std::max<int64_t>(std::min(kSlice, n), 1);
  Tensor mine = Tensor::empty({slice}, DType::F32, device);
  Tensor gathered = Tensor::empty({size * slice}, DType::F32, device);
  std::vector<size_t> next(static_cast<size_t>(size), 0);  // each rank's first run not yet placed
  for (int64_t k = 0; k < n; k += slice) {
    const int64_t m = std::min(slice, n - k);
    const Tensor send = mine.narrow(0, m), received = gathered.narrow(0, size * m);
    if (local.empty()) send.fill_zero();
    else send.copy_from(Tensor::wrap(const_cast<float*>(local.data() + k), {m}, DType::F32));
    group.all_gather(received, send);
    if (!root) continue;
    const Tensor host = received.to(Device::CPU);
    for (int r = 0; r < size; ++r) {
      const float* values = host.data<float>() + r * m;
      const std::vector<PlacedRun>& of_rank = runs[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      for (; i < of_rank.size() && of_rank[i].local < k + m; ++i) {
        const PlacedRun& run = of_rank[i];
        const int64_t from = std::max(run.local, k), to = std::min(run.local + run.count, k + m);
        std::memcpy(whole.data() + run.whole + (from - run.local), values + (from - k),
                    static_cast<size_t>(to - from) * sizeof(float));
        if (run.local + run.count > k + m) break;  // the rest of this run is in the next slice
      }
    }
  }
}

}  // namespace forge
