#include "model/swiglu_feed_forward.h"

#include <fmt/format.h>

#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace forge {

SwiGluFeedForward::SwiGluFeedForward(const ModelConfig& config)
    : hidden_(config.hidden_size), ffn_(config.ffn_hidden_size), eps_(static_cast<float>(config.norm_eps)) {}

std::vector<ParamSpec> SwiGluFeedForward::param_specs(int layer) const {
  const std::string p = fmt::format("layers.{}.", layer), hf = fmt::format("model.layers.{}.", layer);
  std::vector<ParamSpec> specs(3);
  specs[kNorm] = {p + "mlp_norm.weight", {hidden_}, {{hf + "post_attention_layernorm.weight", hidden_}}, false, layer};
  specs[kGateUp] = {p + "mlp.gate_up.weight",
                    {2 * ffn_, hidden_},
                    {{hf + "mlp.gate_proj.weight", ffn_}, {hf + "mlp.up_proj.weight", ffn_}},
                    true,
                    layer};
  specs[kDown] = {p + "mlp.down.weight", {hidden_, ffn_}, {{hf + "mlp.down_proj.weight", hidden_}}, true, layer, true};
  return specs;
}

void SwiGluFeedForward::lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode,
                                int num_layers) {
  tokens_ = shape.tokens();
  const int64_t n = tokens_;
  auto act = [&](Shape s) { return layout.take(std::move(s), shape.dtype); };
  // The gate/up GEMM output is costly to recompute; the normalized input and the SwiGLU
  // output are not.
  auto costly = [&](Activations& a) {
    a.rstd = layout.take({n}, DType::F32);
    a.gate_up = act({n, 2 * ffn_});
  };
  auto cheap = [&](Activations& a) {
    a.normed = act({n, hidden_});
    a.swiglu = act({n, ffn_});
  };
  layers_ = lay_out_layers<Activations>(num_layers, mode, costly, cheap);
  d_swiglu_ = act({n, ffn_});
  d_gate_up_ = act({n, 2 * ffn_});
}

void SwiGluFeedForward::forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_, &w.linear(kGateUp));
  linear_forward(a.gate_up, a.normed, w.linear(kGateUp));
  swiglu_forward(a.swiglu, a.gate_up, out ? &w.linear(kDown) : nullptr);
  if (!out) return;
  linear_forward(*out, a.swiglu, w.linear(kDown), &x);
}

void SwiGluFeedForward::recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_);
  swiglu_forward(a.swiglu, a.gate_up);
}

void SwiGluFeedForward::backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite,
                                 const Tensor& x, const Tensor& d_stream, const Tensor& d_hidden) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  if (overwrite) grads.tensor(kNorm).fill_zero();  // the norm's backward adds
  // out = x + swiglu @ down^T
  linear_backward(d_swiglu_, grads.linear(kDown), d_stream, a.swiglu, w.linear(kDown), overwrite);
  swiglu_backward(d_gate_up_, d_swiglu_, a.gate_up, &w.linear(kGateUp));
  linear_backward(d_hidden, grads.linear(kGateUp), d_gate_up_, a.normed, w.linear(kGateUp), overwrite);
  rmsnorm_backward(d_stream, grads.tensor(kNorm), d_hidden, x, w.tensor(kNorm), a.rstd);
}

}  // namespace forge
