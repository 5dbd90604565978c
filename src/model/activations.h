// Activation memory of the Transformer: what a training step keeps for its backward, the
// activation-checkpointing modes that trade some of it for recomputation, and the one
// arena it all lives in.
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
// to recompute (matmul and attention outputs), as torchtitan's op-level policy does.
// Buffers that are not kept per layer exist once and are shared by all layers. Recomputed
// work is not counted in model FLOPs (../shared/PERF.md).
//
// NOTE [Activation arena]
// Every activation and backward scratch buffer is laid out once, back to back with
// 256-byte alignment, in a single allocation made when the Transformer is built: no
// allocation happens during a step, and the exact activation footprint of a config is
// known before anything is allocated (activation_bytes), which is what the memory
// estimate and the out-of-memory message use.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"

namespace forge {

enum class ActivationCheckpoint { None, Selective, Full };

// "none" | "selective" | "full" (activation_checkpoint.mode).
ActivationCheckpoint activation_checkpoint_from_name(const std::string& name);
std::string_view activation_checkpoint_name(ActivationCheckpoint mode);

struct LayerActivations {
  Tensor input;        // [N, H] block input (residual stream)
  Tensor rstd_attn;    // [N]
  Tensor normed_attn;  // [N, H]
  Tensor qkv;          // [B, T, Hq + 2 Hkv, D] after rotary embedding
  Tensor attn_out;     // [B, T, Hq, D]
  Tensor lse;          // [B, Hq, T]
  Tensor mid;          // [N, H] residual stream after attention
  Tensor rstd_mlp;     // [N]
  Tensor normed_mlp;   // [N, H]
  Tensor gate_up;      // [N, 2F]
  Tensor swiglu_out;   // [N, F]
};

struct ActivationBuffers {
  std::vector<LayerActivations> layers;
  Tensor final_input, final_rstd, final_normed;
  Tensor logits_chunk, losses;
  // Backward scratch.
  Tensor d_residual, d_normed, d_attn_out, d_qkv, d_swiglu, d_gate_up;
};

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

// Rows of the output head's logits chunk (NOTE [Chunked output head] in transformer.cpp).
int64_t head_chunk_rows(int64_t tokens, int64_t vocab, DType dtype);

// Lays out every buffer of a (micro_batch, seq_len) step in compute dtype `dtype` (fp32
// statistics) under `mode`.
void lay_out_activations(ActivationBuffers& buffers, const ModelConfig& config, int64_t micro_batch,
                         int64_t seq_len, DType dtype, ActivationCheckpoint mode, ArenaLayout& layout);

// Bytes of the activation arena for that step.
int64_t activation_bytes(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, DType dtype,
                         ActivationCheckpoint mode);

}  // namespace forge
