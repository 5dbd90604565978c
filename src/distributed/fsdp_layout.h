// Which rank owns which part of which parameter under FSDP.
//
// NOTE [FSDP layout]
// The parameters are grouped into units, the pieces FSDP gathers and reduces whole:
// unit 0 holds the embedding, unit 1 + i block i's six tensors, and the last unit, the
// head, the final norm and the untied output projection. The embedding and the head are
// separate units because the backward pass finishes them at its two ends: the head's
// gradients are complete before any block's, the embedding's only after every block's,
// so each can be reduced (and its buffer reused) as soon as it is done. Inside a unit the
// parameters follow parameter_specs order, each starting at a multiple of kFsdpAlign
// elements, and the unit's length is padded up to a multiple of world * kFsdpAlign, so it
// splits into `world` equal chunks: rank r owns chunk r of every unit. A rank's shard is
// its chunks of all units, one after the other (unit order); the full buffers of ZeRO-1/2
// hold the units one after the other too. The padding is zeros and stays zero (zero
// gradient, zero weight: AdamW never moves it, and it is excluded from the optimizer).
// A segment is the part of one parameter inside a rank's shard: the optimizer steps on
// segments (each knows its weight-decay flag), and checkpoints read and write them at
// their offsets in the flat index space of NOTE [Checkpoint format].
// Chunks of equal size per unit are what NCCL's reduce-scatter and all-gather need; per
// unit (rather than one flat split of the whole model) so that ZeRO-3 can gather one
// block at a time.
// Under expert parallelism of degree P (NOTE [Expert parallelism] in
// model/expert_dispatch.h) a MoE block's unit has two parts. Its dense part (every
// parameter but the routed experts' stacks) is laid out and split over all `world` ranks
// as above. Its expert part holds this rank's local experts' slices of the stacks
// (expert_stack parameters: experts [j E/P, (j + 1) E/P) for expert-parallel rank j =
// rank % P), padded to a multiple of (world / P) x kFsdpAlign and split over the world / P
// ranks that hold the same experts (rank = g P + j, chunk g). The unit's buffer is the
// dense part, then the expert part; a rank's chunk of the unit is its dense chunk, then its
// expert chunk. Every element of every parameter still belongs to exactly one rank's chunk,
// so the segments of all ranks tile the flat index space once.
// A pipeline rank (NOTE [Pipeline stages] in model/pipeline_stage.h) lays out only its
// stages' parameters (pipeline_stage_specs): the units keep their numbering (unit 0 the
// embedding, 1 + i block i, the last the head, so unit_of_layer holds on every rank), but
// a unit of a block or an end the rank's stages do not hold is empty: no parameters, no
// parts, numel and shard_numel 0, nothing in the buffers, and no collective is ever issued
// for it (the ranks of a shard group hold the same stages, so they all skip the same
// units). specs() stays the whole model's, so FsdpParam::spec and FsdpSegment::spec index
// parameter_specs(config, tensor_parallel) as without stages, and the flat offsets are the
// whole model's too (NOTE [Checkpoint format]): the segments of a pipeline rank's shard
// ranks tile its stages' parameters once, and the pipeline ranks' together tile the model.
// A model of units (FLUX, NOTE [FLUX units] in model/flux_parameters.h) is laid out the same
// way from its specs, each naming its unit in ParamSpec::layer: unit 0 and the last unit
// are its two ends (held in full in every ZeRO stage, as the embedding and head), the units
// between them its blocks; the flat index space is the specs end to end, as a checkpoint's.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/parameters.h"
#include "model/pipeline_stage.h"

namespace forge {

// 64 elements: 128 bytes of bf16, 256 of fp32, so every tensor view and every chunk
// starts on a boundary the vectorized kernels and NCCL are happy with.
inline constexpr int64_t kFsdpAlign = 64;

struct FsdpParam {
  int spec = 0;         // index into parameter_specs (the whole model's, FsdpLayout::specs())
  int64_t offset = 0;       // first element inside the unit
  int64_t numel = 0;
  int64_t flat_offset = 0;  // first element in the whole model's flat index space (FlatParameters(config)'s)
  // What this rank holds of the parameter: all of it, or under expert parallelism an
  // expert stack's slice of local experts (param_begin: its first element in the whole).
  Shape shape;
  int64_t param_begin = 0;
  bool expert = false;  // in the unit's expert part
};

// One part of a unit, split over its own ranks: the dense part over all ranks, a MoE
// block's expert part over the ranks that hold the same experts.
struct FsdpPart {
  int64_t begin = 0, numel = 0;  // within the unit's buffer; numel = ranks * shard_numel
  int64_t shard_begin = 0;       // within a rank's chunk of the unit
  int64_t shard_numel = 0;       // one rank's chunk of the part
  int ranks = 1, index = 0;      // how many ranks split it, and this rank's chunk
  bool expert = false;
};

// Empty (no parameters, no parts, numel 0) when a pipeline rank's stages do not hold it.
struct FsdpUnit {
  std::vector<FsdpParam> params;
  std::vector<FsdpPart> parts;  // the dense part, then (expert parallelism) the expert part
  int64_t numel = 0;         // padded: the parts' sum
  int64_t shard_numel = 0;   // one rank's chunk (of every part)
  int64_t shard_offset = 0;  // where this unit's chunk starts in a rank's shard
  int64_t full_offset = 0;   // where the unit starts in a buffer holding every unit
};

struct FsdpSegment {
  int spec = 0;
  int unit = 0;
  int64_t param_begin = 0;   // first element of the parameter that is in the shard
  int64_t numel = 0;
  int64_t shard_offset = 0;  // where it sits in the rank's shard
  int64_t flat_offset = 0;   // where it sits in the whole model's flat index space (NOTE [Checkpoint format])
  bool weight_decay = true;
};

class FsdpLayout {
 public:
  // expert_parallel: P, dividing world_size and the model's experts (1: none).
  // `tensor_parallel`: the parameters are this tensor-parallel rank's shards (NOTE
  // [Tensor-parallel shards] in model/parameters.h). `pipeline_stages`: the parameters are
  // those of a pipeline rank's stages (pipeline_stage_specs); empty: the whole model's.
  FsdpLayout(const ModelConfig& config, int world_size, int rank, int expert_parallel = 1,
             TensorParallelShard tensor_parallel = {}, const std::vector<PipelineStage>& pipeline_stages = {});
  // A model of `num_units` units (at least 2): specs[i].layer is parameter i's unit (NOTE
  // [FSDP layout]); no expert, tensor or pipeline parallelism.
  FsdpLayout(std::vector<ParamSpec> specs, int num_units, int world_size, int rank);

  int world_size() const { return world_size_; }
  int rank() const { return rank_; }
  int expert_parallel() const { return expert_parallel_; }
  // The whole model's (tensor-parallel rank's) parameters, held or not: what `spec` indexes.
  const std::vector<ParamSpec>& specs() const { return specs_; }
  const std::vector<PipelineStage>& pipeline_stages() const { return pipeline_stages_; }
  const std::vector<FsdpUnit>& units() const { return units_; }
  static constexpr int kEmbeddingUnit = 0;
  static int unit_of_layer(int layer) { return layer + 1; }
  int head_unit() const { return num_units() - 1; }
  bool is_block(int unit) const { return unit > kEmbeddingUnit && unit < head_unit(); }
  int num_units() const { return static_cast<int>(units_.size()); }
  // Whether this rank holds the unit's parameters (false only for a pipeline rank's units
  // of other stages).
  bool holds(int unit) const { return !units_.at(static_cast<size_t>(unit)).params.empty(); }
  // This rank's segments, in shard order.
  const std::vector<FsdpSegment>& segments() const { return segments_; }
  int64_t shard_numel() const { return shard_numel_; }  // this rank's elements, padding included
  int64_t full_numel() const { return full_numel_; }    // every unit, padding included
  int64_t max_block_numel() const;                      // the largest block unit (0 without blocks)
  int64_t max_unit_numel() const;                       // the largest unit
  int64_t max_shard_numel() const;                      // the largest chunk of any unit
  int64_t parameter_count() const;                      // the held parameters' elements, without padding
  int64_t flat_numel() const;                           // the whole model's flat index space

 private:
  // Places the held parameters (specs_ order; unit_of(spec index) their unit) into units_,
  // their expert stacks into expert parts when expert_parallel_ > 1, and cuts the segments.
  void lay_out(const std::vector<ParamSpec>& held, size_t num_units, const std::function<int(size_t)>& unit_of);

  int world_size_, rank_, expert_parallel_;
  std::vector<ParamSpec> specs_;
  std::vector<PipelineStage> pipeline_stages_;
  std::vector<FsdpUnit> units_;
  std::vector<FsdpSegment> segments_;
  int64_t shard_numel_ = 0, full_numel_ = 0;
};

}  // namespace forge
