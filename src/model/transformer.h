// The Llama-family decoder with an explicit forward and backward per block.
//
//   tokens → embedding → [ rmsnorm → qkv → rope → attention → o → +residual
//                         → rmsnorm → gate_up → swiglu → down → +residual ] × L
//          → final rmsnorm → output projection + cross-entropy (in token chunks)
//
// There is no autograd: forward_backward() saves what each block's backward needs in
// activation buffers planned once for (micro_batch, seq_len), then walks the blocks in
// reverse, handing each block's weight gradients to the GradSink as soon as they are
// complete. The model never knows where weights come from or where gradients go
// (ParamSource / GradSink), which keeps it free of communication.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
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
              DType compute_dtype = DType::F32);

  const ModelConfig& config() const { return config_; }
  int64_t micro_batch() const { return micro_batch_; }
  int64_t seq_len() const { return seq_len_; }

  Device device() const { return device_; }

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
  struct LayerActivations {
    Tensor input;      // [N, H] block input (residual stream)
    Tensor rstd_attn;  // [N]
    Tensor normed_attn;  // [N, H]
    Tensor qkv;        // [B, T, Hq + 2 Hkv, D] after rotary embedding
    Tensor attn_out;   // [B, T, Hq, D]
    Tensor lse;        // [B, Hq, T]
    Tensor mid;        // [N, H] residual stream after attention
    Tensor rstd_mlp;   // [N]
    Tensor normed_mlp;   // [N, H]
    Tensor gate_up;    // [N, 2F]
    Tensor swiglu_out;  // [N, F]
  };

  void forward_blocks(const Tensor& tokens, ParamSource& weights);
  LossSum output_head(const Tensor& targets, ParamSource& weights, GradSink* grads, float grad_scale);
  void backward_blocks(const Tensor& tokens, ParamSource& weights, GradSink& grads);

  ModelConfig config_;
  int64_t micro_batch_, seq_len_, tokens_;
  Device device_;
  DType compute_dtype_;
  Tensor rope_cos_, rope_sin_;
  std::vector<LayerActivations> acts_;
  Tensor final_input_, final_rstd_, final_normed_;
  Tensor logits_chunk_, losses_;
  // Backward scratch.
  Tensor d_residual_, d_normed_, d_attn_out_, d_qkv_, d_swiglu_, d_gate_up_;
};

}  // namespace forge
