#include "model/split_by_layer.h"

#include "core/error.h"

namespace forge {

SplitByLayer::SplitByLayer(int boundary, std::unique_ptr<BlockComponent> first, std::unique_ptr<BlockComponent> rest,
                           int first_layer)
    : boundary_(boundary), first_layer_(first_layer), first_(std::move(first)), rest_(std::move(rest)) {
  FORGE_CHECK(boundary_ > 0 && first_ && rest_ && first_layer_ >= 0 && first_layer_ < boundary_,
              "SplitByLayer: boundary {} needs both parts, from block {}", boundary_, first_layer_);
}

std::vector<ParamSpec> SplitByLayer::param_specs(int layer) const { return part(layer).param_specs(layer); }

void SplitByLayer::lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) {
  const int first = boundary_ - first_layer_;  // the stage's blocks before the boundary
  FORGE_CHECK(num_layers > first, "SplitByLayer: {} blocks from block {}, the second part starts at block {}",
              num_layers, first_layer_, boundary_);
  first_->lay_out(layout, shape, mode, first);
  rest_->lay_out(layout, shape, mode, num_layers - first);
}

void SplitByLayer::prepare(const StepShape& shape, Device device) {
  first_->prepare(shape, device);
  rest_->prepare(shape, device);
}

void SplitByLayer::set_sequence_layout(const SequenceLayout* layout) {
  first_->set_sequence_layout(layout);
  rest_->set_sequence_layout(layout);
}

void SplitByLayer::set_expert_dispatch(ExpertDispatch* dispatch) {
  first_->set_expert_dispatch(dispatch);
  rest_->set_expert_dispatch(dispatch);
}

void SplitByLayer::set_data_parallel_counts(DataParallelCounts* counts) {
  first_->set_data_parallel_counts(counts);
  rest_->set_data_parallel_counts(counts);
}

void SplitByLayer::begin_step() {
  first_->begin_step();
  rest_->begin_step();
}

void SplitByLayer::share_step_state(BlockComponent& owner) {
  auto* other = dynamic_cast<SplitByLayer*>(&owner);
  FORGE_CHECK(other && other->boundary_ == boundary_ && other->first_layer_ == first_layer_,
              "SplitByLayer: step state shared with another kind of component or other blocks");
  first_->share_step_state(*other->first_);
  rest_->share_step_state(*other->rest_);
}

void SplitByLayer::forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) {
  stage_part(layer).forward(local(layer), w, x, out);
}

void SplitByLayer::recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) {
  stage_part(layer).recompute_selective(local(layer), w, x);
}

void SplitByLayer::backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite,
                            const Tensor& x, const Tensor& d_stream, const Tensor& d_hidden) {
  stage_part(layer).backward(local(layer), w, grads, overwrite, x, d_stream, d_hidden);
}

double SplitByLayer::auxiliary_loss(double gradient_weight) {
  return first_->auxiliary_loss(gradient_weight) + rest_->auxiliary_loss(gradient_weight);
}

void SplitByLayer::pool_balancing_across_stages() {
  first_->pool_balancing_across_stages();
  rest_->pool_balancing_across_stages();
}

void SplitByLayer::add_pooled_statistics(std::vector<double>& statistics) const {
  first_->add_pooled_statistics(statistics);
  rest_->add_pooled_statistics(statistics);
}

void SplitByLayer::set_pooled_balance(const std::vector<double>& statistics, double gradient_weight) {
  first_->set_pooled_balance(statistics, gradient_weight);
  rest_->set_pooled_balance(statistics, gradient_weight);
}

std::vector<int64_t> SplitByLayer::expert_load(int layer) const {
  return stage_part(layer).expert_load(local(layer));
}

}  // namespace forge
