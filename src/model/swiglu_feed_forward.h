// The feed-forward component of a Llama-family block (NOTE [Composed blocks]):
//   out = x + down(silu(gate(h)) * up(h)),   h = rmsnorm(x)
// gate and up are one fused projection (NOTE [Fused projections] in parameters.h).
#pragma once

#include <vector>

#include "model/block_component.h"
#include "model/config.h"

namespace forge {

class SwiGluFeedForward final : public BlockComponent {
 public:
  explicit SwiGluFeedForward(const ModelConfig& config);

  std::vector<ParamSpec> param_specs(int layer) const override;
  void lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) override;
  void forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) override;
  void recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) override;
  void backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite, const Tensor& x,
                const Tensor& d_stream, const Tensor& d_hidden) override;

 private:
  enum Param : size_t { kNorm, kGateUp, kDown };  // ComponentWeights numbering, param_specs order

  struct Activations {
    Tensor rstd;     // [N] fp32
    Tensor normed;   // [N, H]
    Tensor gate_up;  // [N, 2F]
    Tensor swiglu;   // [N, F]
  };

  int64_t hidden_, ffn_;
  float eps_;
  int64_t tokens_ = 0;
  std::vector<Activations> layers_;
  Tensor d_swiglu_, d_gate_up_;  // backward scratch
};

}  // namespace forge
