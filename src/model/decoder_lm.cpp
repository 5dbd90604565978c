#include "model/decoder_lm.h"

#include <algorithm>

#include "ops/cross_entropy.h"
#include "ops/embedding.h"
#include "ops/linear.h"
#include "ops/moe.h"
#include "ops/placement.h"
#include "ops/elementwise.h"
#include "ops/rmsnorm.h"
#include "ops/vocab_parallel_cross_entropy.h"
#include "model/sequence_parallel.h"

namespace forge {
// NOTE [Chunked output head]
// The output projection and cross-entropy run over chunks of tokens: logits for one chunk
// are computed, turned into loss and (in training) into dlogits in place, and immediately
// pushed back through the projection (dx, dW). Only one chunk of logits ever exists: for
// Llama 3 (vocab 128256) at 8192 tokens full fp32 logits would take 4 GiB. A chunk holds
// as many rows as fit in 2 GiB (a power of two, at least 256; head_chunk_rows in
// activations.cpp): the weight-gradient GEMM of every chunk reads and writes the whole
// fp32 dW (2 GiB for Llama 3), so few large chunks beat many small ones — 8192 rows for
// Llama 3 in bf16, whose 2 GiB of logits replace the 4 GiB fp32 ones.

namespace {

// The pooled balancing loss's statistics in an I64 buffer, as the doubles' bits (NOTE
// [Pooled balancing loss across stages] in model/moe_feed_forward.h).
std::vector<double> read_statistics(const Tensor& buffer) {
  std::vector<double> statistics(static_cast<size_t>(buffer.numel()));
  copy_bytes(statistics.data(), Device::CPU, buffer.raw(), buffer.device(), statistics.size() * sizeof(double));
  return statistics;
}

void write_statistics(const Tensor& buffer, const std::vector<double>& statistics) {
  FORGE_CHECK(static_cast<int64_t>(statistics.size()) == buffer.numel(),
              "pooled balancing statistics: {} values for a buffer of {}", statistics.size(), buffer.numel());
  copy_bytes(buffer.raw(), buffer.device(), statistics.data(), Device::CPU, statistics.size() * sizeof(double));
}

const ModelConfig& validated(const ModelConfig& config) {
  config.validate();
  return config;
}

// NOTE [Pipeline stages]: the stage with its end resolved, checked against the model.
PipelineStage resolved(const ModelConfig& config, PipelineStage stage) {
  if (stage.end_layer < 0) stage.end_layer = config.num_layers;
  FORGE_CHECK(stage.first_layer >= 0 && stage.first_layer < stage.end_layer && stage.end_layer <= config.num_layers,
              "pipeline stage: blocks [{}, {}) of a {}-block model", stage.first_layer, stage.end_layer,
              config.num_layers);
  return stage;
}

// Every buffer of a step: the decoder's own (the residual stream between components, the
// head, the shared backward scratch) and each component's.
void lay_out_decoder(DecoderActivations& b, BlockComponents& components, const ModelConfig& config,
                     const StepShape& shape, ActivationCheckpoint mode, const PipelineStage& stage,
                     ArenaLayout& layout) {
  const int layers = stage.end_layer - stage.first_layer;
  const int64_t n = shape.tokens(), rows = shape.stream_rows(), h = config.hidden_size;
  const int64_t vocab = config.vocab_size / shape.tensor_parallel;  // the rank's columns of the logits
  auto act = [&](Shape s) { return layout.take(std::move(s), shape.dtype); };
  auto stat = [&](Shape s) { return layout.take(std::move(s), DType::F32); };
  std::vector<Tensor> shared(components.size());
  if (mode == ActivationCheckpoint::Full)
    for (size_t c = 1; c < components.size(); ++c) shared[c] = act({rows, h});
  b.stream.assign(static_cast<size_t>(layers), std::vector<Tensor>(components.size()));
  for (std::vector<Tensor>& block : b.stream)
    for (size_t c = 0; c < components.size(); ++c)
      block[c] = c > 0 && mode == ActivationCheckpoint::Full ? shared[c] : act({rows, h});
  for (auto& component : components) component->lay_out(layout, shape, mode, layers);
  b.final_input = act({rows, h});  // a stage's output (NOTE [Pipeline stages])
  const int64_t chunk = head_chunk_rows(n, vocab, shape.dtype);
  if (stage.head) {
    b.final_rstd = stat({rows});
    b.final_normed = act({rows, h});
    b.logits_chunk = act({chunk, vocab});
    b.losses = stat({n});
  }
  b.d_stream = act({rows, h});
  b.d_hidden = act({rows, h});
  if (shape.tensor_parallel > 1) {
    b.gathered = act({n, h});
    b.d_gathered = act({n, h});
    if (stage.head) {
      b.row_max = stat({chunk});
      b.ce_sums = stat({2 * chunk});
      b.norm_grad = stat({h});
    }
  }
  if (shape.context_parallel > 1) {
    b.local_tokens = layout.take({n}, DType::I32);
    b.local_targets = layout.take({n}, DType::I32);
    b.loss_sum = stat({1});
  }
}

int64_t count_bytes(BlockComponents& components, const ModelConfig& config, const StepShape& shape,
                    ActivationCheckpoint mode, const PipelineStage& stage) {
  DecoderActivations counted;
  ArenaLayout counting(nullptr, Device::CPU);
  lay_out_decoder(counted, components, config, shape, mode, stage, counting);
  return counting.bytes();
}

}  // namespace

int64_t activation_bytes(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, DType dtype,
                         ActivationCheckpoint mode, int64_t expert_parallel, int64_t tensor_parallel,
                         int64_t context_parallel, PipelineStage stage, ContextParallelRotate rotate) {
  const PipelineStage resolved_stage = resolved(validated(config), stage);
  BlockComponents components = make_block_components(config, resolved_stage);
  check_context_parallel(config, context_parallel, seq_len);
  return count_bytes(components, config,
                     StepShape{micro_batch, seq_len, dtype, expert_parallel, tensor_parallel, context_parallel, rotate},
                     mode, resolved_stage);
}

DecoderLM::DecoderLM(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device,
                     DType compute_dtype, ActivationCheckpoint checkpoint, ExpertDispatch* experts,
                     TensorParallel* tensor_parallel, ContextParallel* context_parallel, PipelineStage stage)
    : DecoderLM(config, micro_batch, seq_len, device, compute_dtype, checkpoint,
                make_block_components(validated(config), resolved(config, stage)), experts, tensor_parallel,
                context_parallel, stage) {}

DecoderLM::DecoderLM(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device,
                     DType compute_dtype, ActivationCheckpoint checkpoint, BlockComponents components,
                     ExpertDispatch* experts, TensorParallel* tensor_parallel, ContextParallel* context_parallel,
                     PipelineStage stage)
    : config_(config),
      micro_batch_(micro_batch),
      seq_len_(seq_len),
      tokens_(micro_batch * seq_len),
      tp_(tensor_parallel && tensor_parallel->size() > 1 ? tensor_parallel : nullptr),
      cp_(context_parallel && context_parallel->size() > 1 ? context_parallel : nullptr),
      stage_(resolved(config_, stage)),
      layers_(stage_.end_layer - stage_.first_layer),
      rank_tokens_(cp_ ? tokens_ / cp_->size() : tokens_),
      device_(device),
      compute_dtype_(compute_dtype),
      checkpoint_(checkpoint),
      components_(std::move(components)) {
  config_.validate();
  FORGE_CHECK(micro_batch >= 1 && seq_len >= 1, "micro_batch {} seq_len {}", micro_batch, seq_len);
  FORGE_CHECK(device == Device::CUDA ? compute_dtype == DType::BF16 : compute_dtype == DType::F32,
              "compute dtype {} on {} (NOTE [Op placement])", dtype_name(compute_dtype), device_name(device));
  FORGE_CHECK(!components_.empty(), "a decoder block needs at least one component");
  const TensorParallelShard shard = tp_ ? TensorParallelShard{tp_->rank(), tp_->size()} : TensorParallelShard{};
  const int64_t cp_degree = cp_ ? cp_->size() : 1;
  if (cp_) {  // NOTE [Context parallelism]
    check_context_parallel(config_, cp_degree, seq_len_);
    for (const auto& component : components_)
      FORGE_CHECK(component->context_parallel_capable(),
                  "context parallelism: model '{}' has a block component that does not split sequences over ranks "
                  "(the dense Llama-family blocks do; Multi-head Latent Attention and Mixture-of-Experts blocks do "
                  "not)",
                  config_.name);
  }
  if (tp_) {  // NOTE [Tensor parallelism]
    check_tensor_parallel(config_, shard.size);
    for (const auto& component : components_)
      FORGE_CHECK(component->tensor_parallel_capable(),
                  "tensor parallelism: model '{}' has a block component that does not split over ranks (the dense "
                  "Llama-family blocks do; Multi-head Latent Attention and Mixture-of-Experts blocks do not)",
                  config_.name);
    FORGE_CHECK(rank_tokens_ % shard.size == 0,
                "tensor parallelism over {} ranks splits the {} tokens a rank computes on (training.local_batch_size "
                "x training.seq_len{}) into the ranks' rows of the residual stream, which it must divide",
                shard.size, rank_tokens_, cp_ ? " / the context-parallel degree" : "");
  }
  // The components must declare, in order, the parameters the weights will be laid out by
  // (the stage's blocks', named by the model's layer index: NOTE [Pipeline stages]).
  std::vector<std::vector<ParamSpec>> expected(static_cast<size_t>(layers_));
  for (ParamSpec& spec : parameter_specs(config_, shard))
    if (spec.layer >= stage_.first_layer && spec.layer < stage_.end_layer)
      expected.at(static_cast<size_t>(spec.layer - stage_.first_layer)).push_back(std::move(spec));
  for (int i = 0; i < layers_; ++i) {
    std::vector<ParamSpec> declared;
    std::vector<size_t> first{0};
    for (const auto& component : components_) {
      for (const ParamSpec& spec : component->param_specs(stage_.first_layer + i))
        declared.push_back(tensor_parallel_spec(spec, shard));
      first.push_back(declared.size());
    }
    const std::vector<ParamSpec>& model = expected[static_cast<size_t>(i)];
    FORGE_CHECK(declared.size() == model.size(), "block {}'s components declare {} parameters, the model has {}",
                stage_.first_layer + i,
                declared.size(), model.size());
    for (size_t k = 0; k < declared.size(); ++k)
      FORGE_CHECK(declared[k].name == model[k].name && declared[k].shape == model[k].shape,
                  "block parameter {} is '{}' {} in the components, '{}' {} in the model", k, declared[k].name,
                  shape_str(declared[k].shape), model[k].name, shape_str(model[k].shape));
    first_param_.push_back(std::move(first));
  }

  const int64_t expert_parallel = experts ? experts->size() : 1;
  FORGE_CHECK(expert_parallel == 1 || (config_.moe() && config_.num_experts % expert_parallel == 0),
              "expert parallelism over {} ranks needs a Mixture-of-Experts model whose experts it divides ({} experts)",
              expert_parallel, config_.num_experts);
  const StepShape shape{micro_batch, seq_len, compute_dtype, expert_parallel, shard.size, cp_degree};
  for (auto& component : components_) {
    component->set_expert_dispatch(experts);
    if (tp_) component->set_tensor_parallel(tp_);
    if (cp_) component->set_context_parallel(cp_);
    component->prepare(shape, device);
  }
  arena_ = Tensor::empty({count_bytes(components_, config_, shape, checkpoint, stage_)}, DType::U8, device);
  ArenaLayout layout(arena_.raw(), device);
  lay_out_decoder(b_, components_, config_, shape, checkpoint, stage_, layout);
  // NOTE [Pooled balancing loss across stages] in model/moe_feed_forward.h.
  pooled_across_stages_ = config_.moe() && config_.router_aux_loss_coef > 0 &&
                          config_.router_aux_loss_type == "pooled" && !(stage_.embedding && stage_.head);
  if (pooled_across_stages_) {
    const int64_t values = static_cast<int64_t>(moe_balancing_statistics_zero(config_.num_experts).size());
    for (Tensor* t : {&statistics_in_, &statistics_out_, &statistics_pooled_})
      *t = Tensor::zeros({values}, DType::I64, device);
    for (auto& component : components_) component->pool_balancing_across_stages();
  }
}

ComponentWeights DecoderLM::component_weights(int i, const BlockWeights& block, size_t c) const {
  const std::vector<size_t>& first = first_param_.at(static_cast<size_t>(i));
  FORGE_CHECK(block.params.size() == first.back(), "block {}'s weights hold {} parameters, its components {}",
              stage_.first_layer + i,
              block.params.size(), first.back());
  return ComponentWeights(block, first[c], first[c + 1] - first[c]);
}

const Tensor& DecoderLM::component_output(int i, size_t c) const {
  if (c + 1 < components_.size()) return b_.stream[static_cast<size_t>(i)][c + 1];
  if (i + 1 < layers_) return b_.stream[static_cast<size_t>(i) + 1][0];
  return b_.final_input;
}

std::vector<std::vector<int64_t>> DecoderLM::expert_load() const {
  std::vector<std::vector<int64_t>> load;
  for (int i = 0; i < layers_; ++i) {
    std::vector<int64_t> block;
    for (const auto& component : components_) {
      const std::vector<int64_t> part = component->expert_load(i);
      block.insert(block.end(), part.begin(), part.end());
    }
    if (!block.empty()) load.push_back(std::move(block));
  }
  return load;
}

void DecoderLM::set_data_parallel_counts(DataParallelCounts* counts) {
  for (const auto& component : components_) component->set_data_parallel_counts(counts);
}

void DecoderLM::begin_step() {
  for (const auto& component : components_) component->begin_step();
}

void DecoderLM::share_step_state(DecoderLM& owner) {
  FORGE_CHECK(owner.stage_.first_layer == stage_.first_layer && owner.layers_ == layers_ &&
                  owner.components_.size() == components_.size(),
              "DecoderLM: step state shared with a model of other blocks");
  for (size_t c = 0; c < components_.size(); ++c) components_[c]->share_step_state(*owner.components_[c]);
}

void DecoderLM::forward_block(int i, const BlockWeights& w, bool to_output) {
  for (size_t c = 0; c < components_.size(); ++c) {
    const bool produce = to_output || c + 1 < components_.size();
    components_[c]->forward(i, component_weights(i, w, c), b_.stream[static_cast<size_t>(i)][c],
                            produce ? &component_output(i, c) : nullptr);
  }
}

void DecoderLM::forward_blocks(const Tensor& tokens, ParamSource& weights, const SequenceLayout* layout) {
  if (layout) {
    expect_tensor(layout->positions, Device::CPU, DType::I32, "sequence layout positions");
    expect_tensor(layout->segments, Device::CPU, DType::I32, "sequence layout segments");
    check_shape(layout->positions, {micro_batch_, seq_len_}, "sequence layout positions");
    check_shape(layout->segments, {micro_batch_, seq_len_}, "sequence layout segments");
    const int32_t* p = layout->positions.data<int32_t>();
    for (int64_t i = 0; i < tokens_; ++i)
      FORGE_CHECK(p[i] >= 0 && p[i] < seq_len_, "sequence layout: position {} of token {} is outside [0, {})", p[i],
                  i, seq_len_);
  }
  for (auto& component : components_) component->set_sequence_layout(layout);
  if (stage_.embedding) {  // else the previous stage's output is in stage_input()
    check_shape(tokens, {micro_batch_, seq_len_}, "tokens");
    const Tensor ids = rank_tokens(tokens, b_.local_tokens);
    if (tp_) {
      // NOTE [Tensor parallelism]: each rank looks up the tokens of its vocabulary rows; the
      // reduce-scatter sums the lookups and leaves each rank its rows of the stream.
      embedding_shard_forward(b_.d_gathered, ids, weights.embedding(), vocab_begin(), config_.vocab_size);
      tp_->reduce_scatter_rows(b_.stream[0][0], b_.d_gathered);
    } else {
      embedding_forward(b_.stream[0][0], ids, weights.embedding());
    }
  }
  for (int i = 0; i < layers_; ++i) forward_block(i, weights.layer(stage_.first_layer + i), true);
  if (!stage_.head) return;  // the stage's output is in stage_output()
  rmsnorm_forward(b_.final_normed, b_.final_rstd, b_.final_input, weights.final_norm(),
                  static_cast<float>(config_.norm_eps));
  if (tp_) tp_->gather_rows(b_.gathered, b_.final_normed);  // the head reads every token
}

int64_t DecoderLM::vocab_begin() const { return tp_ ? tp_->rank() * (config_.vocab_size / tp_->size()) : 0; }

Tensor DecoderLM::rank_tokens(const Tensor& tokens, const Tensor& local) {
  if (!cp_) return tokens.view({tokens_});
  // NOTE [Context parallelism]: the rank's two chunks of every row, chunk-major.
  take_chunks(local.view({2 * micro_batch_, rank_tokens_ / (2 * micro_batch_)}), tokens, cp_->rank(), cp_->size());
  return local;
}

LossSum DecoderLM::micro_batch_loss(const LossSum& local, const Tensor& targets) {
  // NOTE [Context parallelism]: the ranks' sums added over the group; the unmasked targets
  // counted in the micro-batch, which every rank holds.
  const float sum = static_cast<float>(local.sum);
  copy_bytes(b_.loss_sum.raw(), device_, &sum, Device::CPU, sizeof(float));
  cp_->all_reduce_sum(b_.loss_sum);
  float total = 0.0f;
  copy_bytes(&total, Device::CPU, b_.loss_sum.raw(), device_, sizeof(float));
  LossSum loss{total, 0};
  const Tensor host_targets = targets.to(Device::CPU);
  for (int64_t i = 0; i < tokens_; ++i) loss.tokens += host_targets.data<int32_t>()[i] != kIgnoreIndex;
  return loss;
}

void DecoderLM::chunk_cross_entropy(const Tensor& losses, const Tensor& logits, const Tensor& targets, bool grads,
                                    float grad_scale) {
  if (!tp_)
    return cross_entropy_forward_backward(losses, grads ? logits : Tensor(), logits, targets, kIgnoreIndex,
                                          grad_scale);
  // NOTE [Tensor parallelism]: the rank holds the chunk's logits of its vocabulary columns;
  // the row maximum, then the sum of exponentials and the target's logit, over the group.
  const int64_t rows = logits.dim(0);
  const Tensor row_max = b_.row_max.narrow(0, rows);
  const Tensor sums = b_.ce_sums.narrow(0, 2 * rows).view({2, rows});
  vocab_parallel_cross_entropy_max(row_max, logits);
  tp_->all_reduce_max(row_max);
  vocab_parallel_cross_entropy_sums(sums, logits, row_max, targets, vocab_begin(), kIgnoreIndex);
  tp_->all_reduce_sum(sums);
  vocab_parallel_cross_entropy_finish(losses, grads ? logits : Tensor(), logits, row_max, sums, targets,
                                      vocab_begin(), kIgnoreIndex, grad_scale);
}

void DecoderLM::recompute_block(int i, const BlockWeights& w) {
  switch (checkpoint_) {
    case ActivationCheckpoint::None: return;
    case ActivationCheckpoint::Full: return forward_block(i, w, false);
    case ActivationCheckpoint::Selective:
      for (size_t c = 0; c < components_.size(); ++c)
        components_[c]->recompute_selective(i, component_weights(i, w, c), b_.stream[static_cast<size_t>(i)][c]);
      return;
  }
}

LossSum DecoderLM::output_head(const Tensor& targets, ParamSource& weights, GradSink* grads, float grad_scale) {
  check_shape(targets, {micro_batch_, seq_len_}, "targets");
  const int64_t n = rank_tokens_;
  const Tensor flat_targets = rank_tokens(targets, b_.local_targets);
  const LinearWeight& w_out = weights.output();
  // NOTE [Fresh gradient buffers]: a tied output's gradient is the embedding's.
  bool overwrite = false;
  if (grads) {
    grads->output_grad();  // hands the buffer out before asking whether it is fresh
    overwrite = config_.tie_word_embeddings ? grads->embedding_grad_fresh() : grads->head_grads_fresh();
  }
  // Under tensor parallelism the head reads every rank's rows and its input gradient is a
  // partial sum over the rank's vocabulary, summed and scattered after the last chunk.
  const Tensor& input = tp_ ? b_.gathered : b_.final_normed;
  const Tensor& d_input = tp_ ? b_.d_gathered : b_.d_hidden;
  const int64_t chunk_rows = b_.logits_chunk.dim(0);
  for (int64_t begin = 0; begin < n; begin += chunk_rows) {
    int64_t end = std::min(n, begin + chunk_rows);
    Tensor logits = b_.logits_chunk.narrow(0, end - begin);
    Tensor x = input.narrow(begin, end);
    linear_forward(logits, x, w_out);
    chunk_cross_entropy(b_.losses.narrow(begin, end), logits, flat_targets.narrow(begin, end), grads != nullptr,
                        grad_scale);
    if (grads) {
      linear_backward_input(d_input.narrow(begin, end), logits, w_out);
      linear_backward_weight(grads->output_grad(), logits, x, overwrite && begin == 0);
    }
  }
  if (grads && tp_) tp_->reduce_scatter_rows(b_.d_hidden, b_.d_gathered);
  LossSum loss;
  const Tensor host_losses = b_.losses.to(Device::CPU), host_targets = flat_targets.to(Device::CPU);
  const float* l = host_losses.data<float>();
  const int32_t* t = host_targets.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == kIgnoreIndex) continue;
    loss.sum += l[i];
    ++loss.tokens;
  }
  return cp_ ? micro_batch_loss(loss, targets) : loss;
}

void DecoderLM::backward_blocks(const Tensor& tokens, ParamSource& weights, GradSink& grads) {
  if (stage_.head) {  // else the next stage's gradient is in stage_output_grad() = d_stream
    b_.d_stream.fill_zero();
    const Tensor& final_norm_grad = grads.final_norm_grad();
    if (grads.head_grads_fresh()) final_norm_grad.fill_zero();  // the norm's backward adds
    if (tp_) {
      // NOTE [Tensor parallelism]: the replicated norm's gradient summed over the group.
      replicated_rmsnorm_backward(*tp_, b_.norm_grad, b_.d_stream, final_norm_grad, b_.d_hidden, b_.final_input,
                                  weights.final_norm(), b_.final_rstd);
    } else {
      rmsnorm_backward(b_.d_stream, final_norm_grad, b_.d_hidden, b_.final_input, weights.final_norm(),
                       b_.final_rstd);
    }
    grads.head_done();
  }
  for (int i = layers_ - 1; i >= 0; --i) {
    const int layer = stage_.first_layer + i;
    const BlockWeights& w = weights.layer(layer);
    const BlockWeights& g = grads.layer_grads(layer);
    // Weight gradients: written over a fresh buffer, added to one that holds earlier
    // micro-batches' (NOTE [Fresh gradient buffers]).
    const bool fresh = grads.layer_grads_fresh(layer);
    recompute_block(i, w);
    for (size_t c = components_.size(); c-- > 0;)
      components_[c]->backward(i, component_weights(i, w, c), component_weights(i, g, c), fresh,
                               b_.stream[static_cast<size_t>(i)][c], b_.d_stream, b_.d_hidden);
    grads.layer_done(layer);
  }
  if (!stage_.embedding) return;  // the input's gradient is in stage_input_grad() = d_stream
  const Tensor& embedding_grad = grads.embedding_grad();
  if (embedding_grad.defined()) {  // undefined: a frozen embedding (NOTE [LoRA training])
    if (grads.embedding_grad_fresh()) embedding_grad.fill_zero();  // the scatter-add only touches the batch's tokens
    const Tensor ids = rank_tokens(tokens, b_.local_tokens);
    if (tp_) {  // every token's gradient, added to the rows of the rank's vocabulary
      tp_->gather_rows(b_.gathered, b_.d_stream);
      embedding_shard_backward(embedding_grad, b_.gathered, ids, vocab_begin(), config_.vocab_size);
    } else {
      embedding_backward(embedding_grad, b_.d_stream, ids);
    }
  }
  grads.embedding_done();
}

LossSum DecoderLM::stage_forward(const Tensor& tokens, const Tensor& targets, ParamSource& weights,
                                 GradSink* grads, float grad_scale, const SequenceLayout* layout) {
  forward_blocks(tokens, weights, layout);
  LossSum loss;
  if (stage_.head) {
    loss = output_head(targets, weights, grads, grad_scale);
  } else if (grads && config_.moe()) {
    // NOTE [Pipeline stages]: the auxiliary losses of the stage's blocks, weighted by the
    // micro-batch's targets, which every stage is handed.
    check_shape(targets, {micro_batch_, seq_len_}, "targets");
    const Tensor host_targets = targets.to(Device::CPU);
    for (int64_t i = 0; i < tokens_; ++i) loss.tokens += host_targets.data<int32_t>()[i] != kIgnoreIndex;
  }
  if (!grads) return loss;
  // NOTE [MoE balancing loss]: a component's loss counts as the micro-batch's mean, weighted
  // like its cross-entropy.
  const double weight = static_cast<double>(grad_scale) * static_cast<double>(loss.tokens);
  for (auto& component : components_)
    loss.sum += component->auxiliary_loss(weight) * static_cast<double>(loss.tokens);
  if (pooled_across_stages_) loss.sum += pooled_balance_forward(weight) * static_cast<double>(loss.tokens);
  if (!stage_.head) loss.tokens = 0;  // the targets are counted on the last stage
  return loss;
}

double DecoderLM::pooled_balance_forward(double gradient_weight) {
  std::vector<double> statistics = stage_.embedding ? moe_balancing_statistics_zero(config_.num_experts)
                                                    : read_statistics(statistics_in_);
  for (const auto& component : components_) component->add_pooled_statistics(statistics);
  pooled_weight_ = gradient_weight;
  if (!stage_.head) {
    write_statistics(statistics_out_, statistics);
    return 0.0;
  }
  write_statistics(statistics_pooled_, statistics);
  for (const auto& component : components_) component->set_pooled_balance(statistics, gradient_weight);
  return config_.router_aux_loss_coef * moe_statistics_balancing_loss(statistics).loss;
}

void DecoderLM::stage_backward(const Tensor& tokens, ParamSource& weights, GradSink& grads) {
  if (pooled_across_stages_ && !stage_.head) {  // the whole model's statistics came with the gradient
    const std::vector<double> statistics = read_statistics(statistics_pooled_);
    for (const auto& component : components_) component->set_pooled_balance(statistics, pooled_weight_);
  }
  backward_blocks(tokens, weights, grads);
}

LossSum DecoderLM::forward_backward(const Tensor& tokens, const Tensor& targets, ParamSource& weights,
                                    GradSink& grads, float grad_scale, const SequenceLayout* layout) {
  const LossSum loss = stage_forward(tokens, targets, weights, &grads, grad_scale, layout);
  stage_backward(tokens, weights, grads);
  return loss;
}

LossSum DecoderLM::forward_loss(const Tensor& tokens, const Tensor& targets, ParamSource& weights,
                                const SequenceLayout* layout) {
  return stage_forward(tokens, targets, weights, nullptr, 0.0f, layout);
}

void DecoderLM::forward_logits(const Tensor& tokens, ParamSource& weights, const Tensor& logits,
                               const SequenceLayout* layout) {
  FORGE_CHECK(!tp_ && !cp_, "forward_logits: under tensor or context parallelism no rank holds the full logits");
  FORGE_CHECK(stage_.embedding && stage_.head, "forward_logits: a pipeline stage does not hold the whole model");
  check_shape(logits, {tokens_, config_.vocab_size}, "logits");
  check_dtype(logits, compute_dtype_, "logits");
  forward_blocks(tokens, weights, layout);
  linear_forward(logits, b_.final_normed, weights.output());
}

}  // namespace forge
