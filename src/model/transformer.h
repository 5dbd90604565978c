// The Llama-family decoder with an explicit forward and backward per block.
//
//   tokens → embedding → [ rmsnorm → qkv → rope → attention → o → +residual
//                         → rmsnorm → gate_up → swiglu → down → +residual ] × L
//          → final rmsnorm → output projection + cross-entropy (in token chunks)
//
// There is no autograd: forward_backward() saves what each block's backward needs in
// activation buffers planned once for (micro_batch, seq_len) in one arena (NOTE
// [Activation arena]), then walks the blocks in reverse — recomputing what activation
// checkpointing dropped (NOTE [Activation checkpointing]) — handing each block's weight
// gradients to the GradSink as soon as they are complete. The model never knows where weights come from or where gradients go
// (ParamSource / GradSink), which keeps it free of communication.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "model/activations.h"
#include "model/config.h"
#include "model/parameters.h"

namespace forge {

struct LossSum {
  double sum = 0.0;     // sum of per-token cross-entropy (nats) over unmasked targets
  int64_t tokens = 0;   // number of unmasked targets
  double mean() const { return tokens ? sum / static_cast<double>(tokens) : 0.0; }
};

class Transformer {
 public:
  // Activations live on `device` in compute_dtype (fp32 on the CPU, bf16 on CUDA), with
  // fp32 statistics (NOTE [Op placement]); the weights handed in must match.
  Transformer(const ModelConfig& config, int64_t micro_batch, int64_t seq_len, Device device = Device::CPU,
              DType compute_dtype = DType::F32, ActivationCheckpoint checkpoint = ActivationCheckpoint::None);

  const ModelConfig& config() const { return config_; }
  int64_t micro_batch() const { return micro_batch_; }
  int64_t seq_len() const { return seq_len_; }

  Device device() const { return device_; }
  ActivationCheckpoint checkpoint() const { return checkpoint_; }
  int64_t arena_bytes() const { return arena_.nbytes(); }

  // Loss of one micro-batch (tokens/targets int32 [micro_batch, seq_len] on the model's
  // device), and weight
  // gradients of grad_scale * (sum of token losses) accumulated (+=) into grads.
  LossSum forward_backward(const Tensor& tokens, const Tensor& targets, ParamSource& weights, GradSink& grads,
                           float grad_scale);
  // Loss only (evaluation).
  LossSum forward_loss(const Tensor& tokens, const Tensor& targets, ParamSource& weights);
  // Full logits [micro_batch * seq_len, vocab] in the compute dtype (tests and small-model
  // inspection).
  void forward_logits(const Tensor& tokens, ParamSource& weights, const Tensor& logits);

 private:
  void forward_blocks(const Tensor& tokens, ParamSource& weights);
  // One block's forward. `next` receives the block output (input + MLP); without it the
  // last projection is skipped (recomputation for the backward needs everything before it).
  void forward_layer(int i, ParamSource& weights, const Tensor* next);
  // Restores what the checkpointing mode dropped from layer i's activations.
  void recompute_layer(int i, ParamSource& weights);
  LossSum output_head(const Tensor& targets, ParamSource& weights, GradSink* grads, float grad_scale);
  void backward_blocks(const Tensor& tokens, ParamSource& weights, GradSink& grads);

  ModelConfig config_;
  int64_t micro_batch_, seq_len_, tokens_;
  Device device_;
  DType compute_dtype_;
  ActivationCheckpoint checkpoint_;
  Tensor rope_cos_, rope_sin_;
  Tensor arena_;  // owns the memory every buffer of b_ views
  ActivationBuffers b_;
};

}  // namespace forge
