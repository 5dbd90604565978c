// Where a save puts every element: the shard files, and the pieces of each tensor's
// vector each file holds (NOTE [Checkpoint format] in ckpt/checkpoint.h), in the order the
// metadata lists them.
//
// NOTE [Tensor-parallel checkpoints]
// A checkpoint stays in the whole model's flat index space whatever saved it, so any
// layout resumes any other (resharding is reading other pieces, as torchtitan's DCP and
// Megatron's distributed checkpoints do). Under tensor parallelism of degree T with S
// shard ranks (FSDP's, or 1), each tensor-parallel rank t holds its shards (NOTE
// [Tensor-parallel shards] in model/parameters.h) one after the other: its own flat index
// space, in which FSDP splits and the writers hand in segments. The save keeps that
// split: file f = d T + t (the world rank of shard rank d's tensor-parallel rank t) holds
// range shard_ranges(n, S)[d] of rank t's index space (n elements, the same on every rank)
// of the three vectors, as a format-1 file holds a range of the whole model's; its writers
// are the shard ranks of rank t, each streaming its own segments in whole runs (no
// gather, no element-wise work). Only where the elements belong differs: a piece is a
// band range of its tensor (NOTE [Column bands] in ckpt/checkpoint_bands.h), the part of
// the file's range inside one stretch of the rank's shard: a row-parallel projection's
// columns make one band piece per file, a column-parallel projection's rows one whole-width
// piece per stacked tensor. The replicated parameters (the norm weights), the same on every
// tensor-parallel rank, are written once: only rank 0's files hold them, so the files of
// ranks t > 0 skip those elements and are shorter. The metadata (format_version 2) lists
// each file's element count and each piece's band; the pieces of a tensor tile it once.
// Without tensor parallelism the layout is format 1's, byte for byte as before.
#pragma once

#include <cstdint>
#include <vector>

#include "ckpt/checkpoint.h"
#include "ckpt/checkpoint_bands.h"

namespace forge {

// One piece: the part of one tensor's vector that one file holds.
struct PieceLayout {
  FlatState state = FlatState::Param;
  int rank = 0;                          // the shard file rank-<rank>.bin
  int64_t flat_begin = 0, flat_end = 0;  // in the index space its writers' segments use
  int64_t byte_offset = 0;               // in the file
  size_t spec = 0;                       // the tensor (index into the specs)
  BandRange whole;                       // where its elements lie in the whole model
};

struct CheckpointLayout {
  // Above 1: format 2 (NOTE [Tensor-parallel checkpoints]); file f lies in tensor-parallel
  // rank f % tensor_parallel's index space.
  int tensor_parallel = 1;
  std::vector<ShardRange> ranges;   // each file's range of its writers' index space
  std::vector<int64_t> file_numel;  // elements of each vector in each file
  std::vector<PieceLayout> pieces;  // metadata order: by vector, by tensor, by file
  int format_version() const;
  int files() const { return static_cast<int>(file_numel.size()); }
};

// Format 1: file r holds range ranges[r] of the whole model's flat index space (`specs`
// one after the other); the ranges must tile it.
CheckpointLayout checkpoint_layout(const std::vector<ParamSpec>& specs, const std::vector<ShardRange>& ranges);
// NOTE [Tensor-parallel checkpoints]: the files of `degree` tensor-parallel ranks with
// `shards` shard ranks each (format 1's for degree 1).
CheckpointLayout tensor_parallel_checkpoint_layout(const ModelConfig& model, int degree, int shards);

// Format 1's pieces (checkpoint_layout(...).pieces).
std::vector<PieceLayout> checkpoint_pieces(const ModelConfig& model, const std::vector<ShardRange>& ranges);
// The same for a checkpoint of other tensors than the model's parameters (NOTE [LoRA
// checkpoints] in ckpt/checkpoint.h).
std::vector<PieceLayout> checkpoint_pieces(const std::vector<ParamSpec>& specs, const std::vector<ShardRange>& ranges);

// The band range a piece of the metadata covers (its record's tensor, NOTE [Column bands]).
BandRange piece_band(const TensorRecord& record, const TensorPiece& piece);

}  // namespace forge
