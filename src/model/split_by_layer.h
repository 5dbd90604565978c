// A block component that is one kind in the first blocks and another in the rest:
// DeepSeek's dense SwiGLU feed-forward in its first first_dense_layers blocks, its
// Mixture-of-Experts feed-forward after them (NOTE [Composed blocks]).
//
// Each part is a whole component of its own that sees only its blocks, numbered from 0:
// it lays out activations for its blocks alone and is asked for block `layer - boundary`
// when it is the second part. Parameter names are the exception: param_specs(layer) is
// passed the model's block index, since names say where in the model a weight is.
// In a pipeline stage that starts at block first_layer (NOTE [Pipeline stages]) the other
// calls number the stage's blocks from 0: stage block i is the model's first_layer + i.
#pragma once

#include <memory>
#include <vector>

#include "model/block_component.h"

namespace forge {

class SplitByLayer final : public BlockComponent {
 public:
  // `first` in blocks [0, boundary), `rest` in [boundary, num_layers); 0 < boundary; the
  // blocks it is asked for start at the model's block `first_layer` < boundary.
  SplitByLayer(int boundary, std::unique_ptr<BlockComponent> first, std::unique_ptr<BlockComponent> rest,
               int first_layer = 0);

  std::vector<ParamSpec> param_specs(int layer) const override;
  void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) override;
  void prepare(const StepShape& shape, Device device) override;
  void set_sequence_layout(const SequenceLayout* layout) override;
  void set_expert_dispatch(ExpertDispatch* dispatch) override;
  void set_data_parallel_counts(DataParallelCounts* counts) override;
  void begin_step() override;
  void share_step_state(BlockComponent& owner) override;  // owner: a SplitByLayer of the same blocks
  void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) override;
  void recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) override;
  void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite, const Tensor& x,
                const Tensor& d_stream, const Tensor& d_hidden) override;
  bool position_wise() const override { return first_->position_wise() && rest_->position_wise(); }
  double auxiliary_loss(double gradient_weight) override;
  void pool_balancing_across_stages() override;
  void add_pooled_statistics(std::vector<double>& statistics) const override;  // first's blocks, then rest's
  void set_pooled_balance(const std::vector<double>& statistics, double gradient_weight) override;
  std::vector<int64_t> expert_load(int layer) const override;

 private:
  // By the model's block index (param_specs).
  BlockComponent& part(int layer) const { return layer < boundary_ ? *first_ : *rest_; }
  // By the stage's block index (every other call): the part, and the block's index in it.
  BlockComponent& stage_part(int block) const { return part(block + first_layer_); }
  int local(int block) const {
    const int layer = block + first_layer_;
    return layer < boundary_ ? block : layer - boundary_;
  }

  int boundary_;
  int first_layer_;
  std::unique_ptr<BlockComponent> first_, rest_;
};

}  // namespace forge
