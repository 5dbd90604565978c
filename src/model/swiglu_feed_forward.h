// The feed-forward component of a Llama-family block (NOTE [Composed blocks]):
//   out = x + down(silu(gate(h)) * up(h)),   h = rmsnorm(x)
// gate and up are one fused projection (NOTE [Fused projections] in parameters.h). Under
// tensor parallelism the rank computes its F/T columns of gate and up (NOTE [Tensor
// parallelism] in model/tensor_parallel.h); under context parallelism the rank's tokens,
// as any others (NOTE [Context parallelism] in model/context_parallel.h).
#pragma once

#include <vector>

#include "model/block_component.h"
#include "model/sequence_parallel.h"
#include "model/config.h"

namespace forge {

class SwiGluFeedForward final : public BlockComponent {
 public:
  explicit SwiGluFeedForward(const ModelConfig& config);

  std::vector<ParamSpec> param_specs(int layer) const override;
  void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) override;
  bool position_wise() const override { return true; }
  bool tensor_parallel_capable() const override { return true; }
  void set_tensor_parallel(TensorParallel* tp) override { edges_.set_group(tp); }
  bool context_parallel_capable() const override { return true; }
  void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) override;
  void recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) override;
  void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite, const Tensor& x,
                const Tensor& d_stream, const Tensor& d_hidden) override;

 private:
  enum Param : size_t { kNorm, kGateUp, kDown };  // ComponentWeights numbering, param_specs order

  // N the tokens, R the stream's rows (N / T), F the rank's columns (all without tensor
  // parallelism).
  struct Activations {
    Tensor rstd;     // [R] fp32
    Tensor normed;   // [R, H]
    Tensor gate_up;  // [N, 2F]
    Tensor swiglu;   // [N, F]
  };

  int64_t hidden_, model_ffn_;
  int64_t ffn_;  // the rank's columns
  float eps_;
  std::vector<Activations> layers_;
  Tensor d_swiglu_, d_gate_up_;  // backward scratch
  SequenceParallelEdges edges_;  // NOTE [Tensor parallelism]: the gathers and reduce-scatters
};

}  // namespace forge
