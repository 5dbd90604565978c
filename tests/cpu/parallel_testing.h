// What the tests of the parallel layouts (expert, tensor, context parallelism) compare
// with: a tensor-parallel rank's shard of a whole parameter, and the largest difference
// between two fp32 tensors relative to the larger one's scale.
#pragma once

#include <algorithm>
#include <cmath>

#include "core/tensor.h"
#include "model/parameters.h"

namespace forge::testing {

// The values of `full` (fp32, on the host) at the places tensor-parallel rank `shard` holds
// (tensor_parallel_runs), shaped as its shard.
inline Tensor shard_of(const Tensor& full, const ParamSpec& spec, TensorParallelShard shard) {
  Tensor out = Tensor::empty(tensor_parallel_spec(spec, shard).shape);
  for (const ShardRun& run : tensor_parallel_runs(spec, shard))
    std::copy(full.data<float>() + run.full_begin, full.data<float>() + run.full_begin + run.count,
              out.data<float>() + run.local_begin);
  return out;
}

// max |a - b| / max |b| (max |a - b| where b is all zeros), fp32 tensors on the host.
inline double relative_gap(const Tensor& a, const Tensor& b) {
  double worst = 0.0, scale = 0.0;
  for (int64_t i = 0; i < b.numel(); ++i) scale = std::max(scale, std::abs(static_cast<double>(b.data<float>()[i])));
  for (int64_t i = 0; i < a.numel(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(a.data<float>()[i]) - b.data<float>()[i]));
  return scale > 0 ? worst / scale : worst;
}

}  // namespace forge::testing
