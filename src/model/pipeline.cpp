#include "model/pipeline.h"

#include <algorithm>

#include "core/error.h"

namespace forge {

void check_pipeline_parallel(const ModelConfig& config, int64_t stages, int64_t virtual_stages) {
  FORGE_CHECK(stages >= 1 && virtual_stages >= 1, "pipeline parallelism: {} stages of {} virtual stages each",
              stages, virtual_stages);
  if (stages * virtual_stages == 1) return;
  const int64_t cut = stages * virtual_stages;
  FORGE_CHECK(config.num_layers % cut == 0,
              "pipeline parallelism cuts model '{}''s {} blocks into pipeline_parallel_degree {} x {} virtual stages "
              "per rank = {} stages of equal length, which must divide them",
              config.name, config.num_layers, stages, virtual_stages, cut);
  FORGE_CHECK(!config.tie_word_embeddings,
              "pipeline parallelism: model '{}' ties its output projection to the embedding, which would then live "
              "on the first and the last stage's ranks at once; set model.tie_word_embeddings false",
              config.name);
}

int64_t pipeline_virtual_stages(const ModelConfig& config, int64_t stages, int64_t layers_per_stage,
                                PipelineScheduleKind kind) {
  if (layers_per_stage <= 0) return kind == PipelineScheduleKind::Interleaved ? 2 : 1;
  return std::max<int64_t>(1, config.num_layers / std::max<int64_t>(1, stages * layers_per_stage));
}

PipelineStage pipeline_stage(const ModelConfig& config, int stages, int virtual_stages, int rank, int chunk) {
  FORGE_CHECK(rank >= 0 && rank < stages && chunk >= 0 && chunk < virtual_stages,
              "pipeline rank {} of {}, chunk {} of {}", rank, stages, chunk, virtual_stages);
  const int count = stages * virtual_stages, s = chunk * stages + rank, per = config.num_layers / count;
  return PipelineStage{s * per, (s + 1) * per, s == 0, s == count - 1};
}

int pipeline_chunk_in_flight(const PipelineSchedule& schedule, int rank, int chunk) {
  const bool first_stage = chunk == 0 && rank == 0;  // its inputs are the tokens, its gradients stay
  int live = 0, most = 1;
  for (const PipelineAction& a : schedule.ranks.at(static_cast<size_t>(rank))) {
    switch (a.kind) {
      case PipelineAction::Kind::Forward:
        if (first_stage && a.chunk == chunk) ++live;
        break;
      case PipelineAction::Kind::Backward:
        if (first_stage && a.chunk == chunk) --live;
        break;
      case PipelineAction::Kind::Exchange:
        for (const PipelineTransfer& t : a.transfers) {
          if (t.chunk != chunk) continue;
          if (!t.send && !t.gradient) ++live;
          if (t.send && t.gradient) --live;
        }
        break;
    }
    most = std::max(most, live);
  }
  return most;
}

PipelineModel::PipelineModel(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device,
                             DType compute_dtype, ActivationCheckpoint checkpoint, PipelineParallel& pipeline,
                             PipelineScheduleKind kind, const PipelineShape& shape, TensorParallel* tensor_parallel,
                             ContextParallel* context_parallel, ExpertDispatch* experts)
    : pipeline_(pipeline), shape_(shape) {
  check_pipeline_shape(kind, shape);
  FORGE_CHECK(pipeline.size() == shape.stages && shape.stages >= 2,
              "pipeline parallelism: a schedule of {} stages on a group of {} ranks (it takes 2 or more)",
              shape.stages, pipeline.size());
  check_pipeline_parallel(config, shape.stages, shape.virtual_stages);
  schedule_ = make_pipeline_schedule(kind, shape);
  if (config.moe()) {
    first_moe_layer_ = static_cast<int>(config.first_dense_layers);
    expert_load_.assign(static_cast<size_t>(config.num_layers - config.first_dense_layers),
                        std::vector<int64_t>(static_cast<size_t>(config.num_experts), 0));
  }
  const int rank = pipeline.rank();
  chunks_.resize(static_cast<size_t>(shape.virtual_stages));
  for (int v = 0; v < shape.virtual_stages; ++v) {
    Chunk& chunk = chunks_[static_cast<size_t>(v)];
    chunk.stage = pipeline_stage(config, shape.stages, shape.virtual_stages, rank, v);
    chunk.slot_of.assign(static_cast<size_t>(shape.micro_batches), -1);
    for (int k = 0; k < pipeline_chunk_in_flight(schedule_, rank, v); ++k) {
      chunk.models.push_back(std::make_unique<DecoderLM>(config, micro_batch, seq_len, device, compute_dtype,
                                                         checkpoint, experts, tensor_parallel, context_parallel,
                                                         chunk.stage));
      chunk.free.push_back(k);
      // NOTE [Global balancing loss across stages] in model/moe_feed_forward.h: the chunk's
      // models count the step's micro-batches together.
      if (k > 0) chunk.models.back()->share_step_state(*chunk.models.front());
    }
  }
  if (config.moe() && config.router_aux_loss_coef > 0 && config.router_aux_loss_type == "global") {
    // Each micro-batch's loss averages the counts of the chunk's forwards before it: those
    // of the micro-batches before it, as on one rank, when every chunk's forwards come in
    // micro-batch order (both schedules' do).
    std::vector<int> next(chunks_.size(), 0);
    for (const PipelineAction& a : schedule_.ranks[static_cast<size_t>(rank)])
      if (a.kind == PipelineAction::Kind::Forward)
        FORGE_CHECK(a.micro_batch == next[static_cast<size_t>(a.chunk)]++,
                    "pipeline: the global balancing loss needs chunk {}'s forwards in micro-batch order; micro-batch "
                    "{} is its forward {}",
                    a.chunk, a.micro_batch, next[static_cast<size_t>(a.chunk)] - 1);
  }
}

void PipelineModel::set_data_parallel_counts(DataParallelCounts* counts) {
  for (Chunk& chunk : chunks_)
    for (const auto& model : chunk.models) model->set_data_parallel_counts(counts);
}

std::vector<PipelineStage> PipelineModel::stages() const {
  std::vector<PipelineStage> out;
  for (const Chunk& chunk : chunks_) out.push_back(chunk.stage);
  return out;
}

int64_t PipelineModel::arena_bytes() const {
  int64_t bytes = 0;
  for (const Chunk& chunk : chunks_)
    for (const auto& model : chunk.models) bytes += model->arena_bytes();
  return bytes;
}

int PipelineModel::in_flight() const {
  int models = 0;
  for (const Chunk& chunk : chunks_) models += static_cast<int>(chunk.models.size());
  return models;
}

int PipelineModel::take_slot(Chunk& chunk, int micro_batch) {
  int& slot = chunk.slot_of.at(static_cast<size_t>(micro_batch));
  if (slot >= 0) return slot;
  FORGE_CHECK(!chunk.free.empty(), "pipeline: no activation buffers left for micro-batch {} (the schedule holds more "
              "micro-batches in flight than counted)", micro_batch);
  slot = chunk.free.back();
  chunk.free.pop_back();
  return slot;
}

DecoderLM& PipelineModel::model_of(int chunk, int micro_batch) {
  Chunk& c = chunks_.at(static_cast<size_t>(chunk));
  const int slot = c.slot_of.at(static_cast<size_t>(micro_batch));
  FORGE_CHECK(slot >= 0, "pipeline: micro-batch {} is not in flight on chunk {}", micro_batch, chunk);
  return *c.models[static_cast<size_t>(slot)];
}

void PipelineModel::release_slot(Chunk& chunk, int micro_batch) {
  int& slot = chunk.slot_of.at(static_cast<size_t>(micro_batch));
  chunk.free.push_back(slot);
  slot = -1;
}

void PipelineModel::exchange(const std::vector<PipelineTransfer>& transfers) {
  std::vector<PipelineParallel::Transfer> moves;
  for (const PipelineTransfer& t : transfers) {
    Chunk& chunk = chunks_.at(static_cast<size_t>(t.chunk));
    if (!t.send && !t.gradient) take_slot(chunk, t.micro_batch);
    DecoderLM& model = model_of(t.chunk, t.micro_batch);
    const Tensor& tensor = t.send ? (t.gradient ? model.stage_input_grad() : model.stage_output())
                                  : (t.gradient ? model.stage_output_grad() : model.stage_input());
    moves.push_back({t.send, t.peer, tensor});
    // NOTE [Pooled balancing loss across stages] in model/moe_feed_forward.h: the pooled
    // statistics follow their tensor to the same peer, so the pairs' messages still match
    // by position.
    if (model.carries_balance_statistics())
      moves.push_back({t.send, t.peer, t.gradient ? model.pooled_statistics()
                                                  : (t.send ? model.stage_output_statistics()
                                                            : model.stage_input_statistics())});
  }
  pipeline_.exchange(moves);
  for (const PipelineTransfer& t : transfers)  // the micro-batch's backward is done on this chunk
    if (t.send && t.gradient) release_slot(chunks_[static_cast<size_t>(t.chunk)], t.micro_batch);
}

LossSum PipelineModel::forward_backward(const std::vector<PipelineMicroBatch>& micro_batches, ParamSource& weights,
                                        GradSink& grads, float grad_scale,
                                        const std::function<void(int micro_batch)>& before_micro_batch) {
  FORGE_CHECK(static_cast<int>(micro_batches.size()) == shape_.micro_batches,
              "pipeline: {} micro-batches for a schedule of {}", micro_batches.size(), shape_.micro_batches);
  LossSum loss;
  for (Chunk& chunk : chunks_) chunk.models.front()->begin_step();  // shared by the chunk's models
  micro_losses_.assign(micro_batches.size(), LossSum{});
  for (std::vector<int64_t>& block : expert_load_) std::fill(block.begin(), block.end(), 0);
  for (const PipelineAction& a : schedule_.ranks[static_cast<size_t>(pipeline_.rank())]) {
    if (a.kind == PipelineAction::Kind::Exchange) {
      exchange(a.transfers);
      continue;
    }
    const PipelineMicroBatch& micro = micro_batches.at(static_cast<size_t>(a.micro_batch));
    Chunk& chunk = chunks_.at(static_cast<size_t>(a.chunk));
    if (before_micro_batch) before_micro_batch(a.micro_batch);
    if (a.kind == PipelineAction::Kind::Forward) {
      take_slot(chunk, a.micro_batch);
      const LossSum l = model_of(a.chunk, a.micro_batch)
                            .stage_forward(micro.tokens, micro.targets, weights, &grads, grad_scale, micro.layout);
      loss.sum += l.sum;
      loss.tokens += l.tokens;
      LossSum& micro_loss = micro_losses_[static_cast<size_t>(a.micro_batch)];  // over the rank's chunks
      micro_loss.sum += l.sum;
      micro_loss.tokens += l.tokens;
      if (!expert_load_.empty()) {  // the stage's MoE blocks, the first at the model's block first_moe
        const std::vector<std::vector<int64_t>> load = model_of(a.chunk, a.micro_batch).expert_load();
        const size_t first_moe = static_cast<size_t>(std::max(chunk.stage.first_layer, first_moe_layer_) - first_moe_layer_);
        for (size_t j = 0; j < load.size(); ++j)
          for (size_t e = 0; e < load[j].size(); ++e) expert_load_.at(first_moe + j).at(e) += load[j][e];
      }
    } else {
      model_of(a.chunk, a.micro_batch).stage_backward(micro.tokens, weights, grads);
      if (chunk.stage.embedding) release_slot(chunk, a.micro_batch);  // no gradient to send
    }
  }
  return loss;
}

LossSum PipelineModel::forward_loss(const PipelineMicroBatch& micro_batch, ParamSource& weights) {
  const int p = shape_.stages, count = p * shape_.virtual_stages, rank = pipeline_.rank();
  LossSum loss;
  for (int s = 0; s < count; ++s) {  // the stages in turn; every rank takes part in every round
    const int owner = s % p, chunk = s / p;
    if (owner == rank) {
      take_slot(chunks_[static_cast<size_t>(chunk)], 0);
      loss = model_of(chunk, 0).stage_forward(micro_batch.tokens, micro_batch.targets, weights, nullptr, 0.0f,
                                              micro_batch.layout);
    }
    if (s + 1 == count) break;
    const int next = (s + 1) % p, next_chunk = (s + 1) / p;
    std::vector<PipelineParallel::Transfer> moves;
    if (owner == rank) moves.push_back({true, next, model_of(chunk, 0).stage_output()});
    if (next == rank) {
      take_slot(chunks_[static_cast<size_t>(next_chunk)], 0);
      moves.push_back({false, owner, model_of(next_chunk, 0).stage_input()});
    }
    pipeline_.exchange(moves);
  }
  for (Chunk& chunk : chunks_)
    if (chunk.slot_of[0] >= 0) release_slot(chunk, 0);
  return loss;
}

}  // namespace forge
