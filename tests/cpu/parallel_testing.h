// What the tests of the parallel layouts (expert, tensor, context, pipeline parallelism)
// compare with: a tensor-parallel rank's shard of a whole parameter, the largest difference
// between two fp32 tensors relative to the larger one's scale; and the packed micro-batch
// they run; a rank's view of the parameters under expert parallelism.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "model/block_component.h"
#include "model/parameters.h"
#include "model/pipeline_stage.h"

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

// Two examples per row of a [micro, seq] micro-batch: positions restart at seq/2 + 1,
// segment ids differ (NOTE [Packed examples]).
inline SequenceLayout packed_layout(int64_t micro, int64_t seq) {
  SequenceLayout layout{Tensor::empty({micro, seq}, DType::I32), Tensor::empty({micro, seq}, DType::I32)};
  const int64_t cut = seq / 2 + 1;
  for (int64_t b = 0; b < micro; ++b)
    for (int64_t t = 0; t < seq; ++t) {
      layout.positions.data<int32_t>()[b * seq + t] = static_cast<int32_t>(t < cut ? t : t - cut);
      layout.segments.data<int32_t>()[b * seq + t] = t < cut ? 0 : 1;
    }
  return layout;
}

// A rank's view of whole-model parameters (or gradients) under expert parallelism: every
// tensor in full but the routed experts' stacks, narrowed to the rank's local experts
// [first, first + count), as FSDP hands them out. With `stages`, a pipeline rank's: only
// those stages' blocks are there.
class LocalExperts final : public ParamSource, public GradSink {
 public:
  LocalExperts(FlatParameters& all, int64_t first, int64_t count, const std::vector<PipelineStage>* stages = nullptr)
      : all_(all), layers_(static_cast<size_t>(all.config().num_layers)) {
    const int layers = all.config().num_layers;
    const std::vector<PipelineStage> whole = {PipelineStage{0, layers}};
    for (const PipelineStage& s : stages ? *stages : whole)
      for (int i = s.first_layer; i < s.end_layer; ++i) {
        BlockWeights block = all.layer(i);
        size_t k = 0;
        for (const ParamSpec& spec : all.specs()) {
          if (spec.layer != i) continue;
          if (spec.expert_stack) block.params[k].weight = block.params[k].weight.narrow(first, first + count);
          ++k;
        }
        layers_[static_cast<size_t>(i)] = std::move(block);
      }
  }
  const Tensor& embedding() override { return all_.embedding(); }
  const BlockWeights& layer(int index) override { return layers_.at(static_cast<size_t>(index)); }
  const Tensor& final_norm() override { return all_.final_norm(); }
  const LinearWeight& output() override { return all_.output(); }
  const BlockWeights& layer_grads(int index) override { return layers_.at(static_cast<size_t>(index)); }
  void layer_done(int index) override { all_.layer_done(index); }
  const Tensor& embedding_grad() override { return all_.embedding_grad(); }
  void embedding_done() override { all_.embedding_done(); }
  const Tensor& final_norm_grad() override { return all_.final_norm_grad(); }
  const LinearWeight& output_grad() override { return all_.output_grad(); }
  void head_done() override { all_.head_done(); }

 private:
  FlatParameters& all_;
  std::vector<BlockWeights> layers_;
};

}  // namespace forge::testing
