// The attention of a self-attention component under context parallelism (NOTE [Context
// parallelism] in model/context_parallel.h): the rank's two query chunks against the keys
// and values of the whole sequences, gathered from the group, and the backward that
// returns each position's key/value gradient to the rank that holds it; or, with the group's
// rotate method Ring, the same by ring attention (model/context_parallel_ring.h). SelfAttention
// holds one and calls it where it would call attention_forward / attention_backward.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/block_component.h"
#include "model/context_parallel.h"
#include "model/context_parallel_ring.h"
#include "ops/attention.h"
#include "ops/attention_chunk.h"

namespace forge {

class ContextParallelAttention {
 public:
  // Scratch shared by every layer for `q_heads` query and `kv_heads` key/value heads of
  // `head_dim` (the rank's, under tensor parallelism), for shape.context_parallel ranks, by
  // `method`: the gathered keys and values, or ring attention's blocks (NOTE [Ring attention]
  // in model/context_parallel_ring.h).
  void lay_out(ArenaLayout& layout, const StepShape& shape, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
               ContextParallelRotate method);
  // The rotary positions of the rank's tokens, int32 [2B, L] on `device`.
  void prepare(const ContextParallel& cp, const StepShape& shape, Device device);
  // The micro-batch's packed examples (null: each row one sequence; NOTE [Chunk attention
  // with packed examples] in ops/attention_chunk.h): the rank's chunks of their positions, and
  // each query chunk's segments for `attention` (under the ring, each chunk pair's: NOTE [Ring
  // attention with packed examples]). After prepare.
  void set_layout(const ContextParallel& cp, const SequenceLayout* layout, const AttentionShape& attention);
  const Tensor& positions() const { return packed_ ? packed_positions_ : positions_; }

  // Block `layer`'s attention of the rank's tokens: qkv [2B, L, Hq + 2Hkv, D] (rotated), out
  // [2B, L, Hq, D], lse [2B, Hq, L], as attention_forward's.
  void forward(ContextParallel& cp, int layer, const Tensor& out, const Tensor& lse, const Tensor& qkv,
               const AttentionShape& shape);
  // Overwrites dqkv (same packing as qkv) from dout [2B, L, Hq, D].
  void backward(ContextParallel& cp, int layer, const Tensor& dqkv, const Tensor& dout, const Tensor& qkv,
                const Tensor& out, const Tensor& lse, const AttentionShape& shape);

 private:
  // The keys and values of every rank's tokens, in sequence order in kv_, from the rank's
  // qkv of block `layer` (nothing to do when they are still there).
  void gather_keys(ContextParallel& cp, int layer, const Tensor& qkv);

  bool ring_ = false;         // ContextParallelRotate::Ring: ring_attention_ computes the attention
  ContextParallelRing ring_attention_;
  int64_t batch_ = 0, chunk_ = 0;  // B, L
  Tensor local_kv_;                // [2B, L, 2Hkv, D]: the rank's keys and values, then their gradient
  Tensor ranks_kv_;                // [C, 2B, L, 2Hkv, D]: every rank's, in rank order; scratch in the backward
  Tensor kv_;                      // [B, S, 2Hkv, D]: in sequence order
  Tensor dkv_;                     // [B, S, 2Hkv, D]: their gradient
  Tensor positions_;  // the tokens' positions in their sequences
  Device device_ = Device::CPU;
  bool packed_ = false;
  Tensor packed_positions_;                 // int32 [2B, L]: in their examples
  AttentionChunkSegments chunk_segments_[2];  // of the rank's first and second query chunk
  int gathered_layer_ = -1;  // the block whose keys and values kv_ holds
};

}  // namespace forge
