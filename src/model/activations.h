// Activation memory of a model: what a training step keeps for its backward, the
// activation-checkpointing modes that trade some of it for recomputation, and the one
// arena it all lives in. Which buffers exist is each model's and each block component's
// own (decoder_lm.h, NOTE [Composed blocks]).
//
// NOTE [Activation checkpointing]
// Mode       kept per layer for the backward                    recomputed in the backward
// none       everything the block's backward reads                nothing
// selective  block input, packed QKV, attention output and        the two RMSNorm outputs and the
//            log-sum-exp, residual after attention, gate/up,      SwiGLU output: memory-bound ops,
//            norm statistics (every GEMM and attention output)    a few % of the layer's time
// full       the block input only                                 the whole block forward (but the
//                                                                 last projection), ~1/3 more FLOPs
// These are torchtitan's activation_checkpoint.mode values; selective keeps what is costly
// to recompute (matmul and attention outputs), as torchtitan's op-level policy does. The
// table is the Llama block's; each block component decides its own part of it
// (NOTE [Composed blocks]). Buffers that are not kept per layer exist once and are shared
// by all layers. Recomputed work is not counted in model FLOPs (../shared/PERF.md).
//
// NOTE [Activation arena]
// Every activation and backward scratch buffer is laid out once, back to back with
// 256-byte alignment, in a single allocation made when the model is built: no
// allocation happens during a step, and the exact activation footprint of a config is
// known before anything is allocated (activation_bytes), which is what the memory
// estimate and the out-of-memory message use.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace forge {

enum class ActivationCheckpoint { None, Selective, Full };

// "none" | "selective" | "full" (activation_checkpoint.mode).
ActivationCheckpoint activation_checkpoint_from_name(const std::string& name);
std::string_view activation_checkpoint_name(ActivationCheckpoint mode);

// Places tensors back to back in one buffer. With no base (the counting pass) take()
// returns undefined tensors and only advances the offset, so the same layout code gives
// both the size and, with the allocated base, the views.
class ArenaLayout {
 public:
  ArenaLayout(void* base, Device device) : base_(static_cast<char*>(base)), device_(device) {}
  Tensor take(Shape shape, DType dtype);
  int64_t bytes() const { return offset_; }

 private:
  char* base_;
  Device device_;
  int64_t offset_ = 0;
};

// A component's per-layer activations under an activation-checkpointing mode (NOTE
// [Activation checkpointing] in block_component.h): costly(a) lays out in `a` what
// selective checkpointing keeps, cheap(a) what it recomputes. none: both per layer;
// selective: costly per layer and one cheap set shared by every layer; full: one set of
// both shared by every layer. Under full, `recomputed` (-1: every layer) limits the shared
// set to the first that many layers; the others keep both sets of their own, as under none
// (NOTE [Recomputing some FLUX blocks] in model/flux_transformer.h).
template <typename Activations, typename Costly, typename Cheap>
std::vector<Activations> lay_out_layers(int num_layers, ActivationCheckpoint mode, Costly costly, Cheap cheap,
                                        int recomputed = -1) {
  if (mode != ActivationCheckpoint::Full || recomputed < 0 || recomputed > num_layers) recomputed = num_layers;
  Activations shared;
  if (mode == ActivationCheckpoint::Full && recomputed > 0) costly(shared);
  if (mode != ActivationCheckpoint::None && recomputed > 0) cheap(shared);
  std::vector<Activations> layers(static_cast<size_t>(num_layers), shared);
  for (int i = 0; i < num_layers; ++i) {
    Activations& a = layers[static_cast<size_t>(i)];
    const bool kept = mode == ActivationCheckpoint::Full && i >= recomputed;
    if (mode != ActivationCheckpoint::Full || kept) costly(a);
    if (mode == ActivationCheckpoint::None || kept) cheap(a);
  }
  return layers;
}

// Rows of the output head's logits chunk (NOTE [Chunked output head] in decoder_lm.cpp).
int64_t head_chunk_rows(int64_t tokens, int64_t vocab, DType dtype);

}  // namespace forge
