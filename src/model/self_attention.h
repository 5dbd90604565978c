// The attention component of a Llama-family block (NOTE [Composed blocks]):
//   out = x + o(attention(rope(qkv(rmsnorm(x)))))
// Causal grouped-query attention (MHA when the KV heads equal the query heads), with a
// sliding window when the config has one (Mistral 7B v0.1), confined to each example when
// the micro-batch packs several (NOTE [Packed examples] in ops/attention.h). Q, K and V come from one fused
// projection (NOTE [Fused projections] in parameters.h); rotary embeddings are applied to
// the query and key heads in place. Under tensor parallelism the rank computes its heads
// (NOTE [Tensor parallelism] in model/tensor_parallel.h); under context parallelism its
// chunks of the sequences against every rank's keys and values (NOTE [Context parallelism]
// in model/context_parallel.h).
#pragma once

#include <vector>

#include "model/block_component.h"
#include "model/sequence_parallel.h"
#include "model/config.h"
#include "model/context_parallel_attention.h"
#include "model/rotary_positions.h"
#include "ops/attention.h"

namespace forge {

class SelfAttention final : public BlockComponent {
 public:
  explicit SelfAttention(const ModelConfig& config);

  std::vector<ParamSpec> param_specs(int layer) const override;
  void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) override;
  void prepare(const StepShape& shape, Device device) override;
  void set_sequence_layout(const SequenceLayout* layout) override;
  bool tensor_parallel_capable() const override { return true; }
  void set_tensor_parallel(TensorParallel* tp) override { edges_.set_group(tp); }
  bool context_parallel_capable() const override { return true; }
  void set_context_parallel(ContextParallel* cp) override { cp_ = cp; }
  void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) override;
  void recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) override;
  void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite, const Tensor& x,
                const Tensor& d_stream, const Tensor& d_hidden) override;

 private:
  enum Param : size_t { kNorm, kQkv, kOut };  // ComponentWeights numbering, param_specs order

  // Hq and Hkv are the rank's heads under tensor parallelism; N the rank's tokens as a
  // batch [B, T] (StepShape::local_batch and local_seq_len), R the stream's rows (N / T).
  struct Activations {
    Tensor rstd;    // [R] fp32
    Tensor normed;  // [R, H]
    Tensor qkv;     // [B, T, Hq + 2 Hkv, D] after rotary embedding
    Tensor out;     // [B, T, Hq, D]
    Tensor lse;     // [B, Hq, T] fp32
  };
  // The rotary positions of the rank's tokens: its chunks' under context parallelism, a
  // packed micro-batch's, or null (0, 1, ... in every row).
  const Tensor* positions() const;

  int64_t hidden_, model_heads_, model_kv_heads_;
  int64_t heads_, kv_heads_;  // the rank's (all of them without tensor parallelism)
  int64_t head_dim_;
  float eps_;
  RotaryPositions rotary_;
  AttentionShape attention_;
  StepShape shape_;
  std::vector<Activations> layers_;
  Tensor d_out_, d_qkv_;  // backward scratch
  SequenceParallelEdges edges_;  // NOTE [Tensor parallelism]: the gathers and reduce-scatters
  ContextParallel* cp_ = nullptr;
  ContextParallelAttention cp_attention_;  // context parallelism: the gathered keys and values
};

}  // namespace forge
