#include "model/swiglu_feed_forward.h"

#include <fmt/format.h>

#include "model/sequence_parallel.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/swiglu.h"

namespace forge {

SwiGluFeedForward::SwiGluFeedForward(const ModelConfig& config)
    : hidden_(config.hidden_size),
      model_ffn_(config.ffn_hidden_size),
      ffn_(config.ffn_hidden_size),
      eps_(static_cast<float>(config.norm_eps)) {}

std::vector<ParamSpec> SwiGluFeedForward::param_specs(int layer) const {
  const std::string p = fmt::format("layers.{}.", layer), hf = fmt::format("model.layers.{}.", layer);
  std::vector<ParamSpec> specs(3);
  specs[kNorm] = {p + "mlp_norm.weight", {hidden_}, {{hf + "post_attention_layernorm.weight", hidden_}}, false, layer};
  specs[kGateUp] = {p + "mlp.gate_up.weight",
                    {2 * model_ffn_, hidden_},
                    {{hf + "mlp.gate_proj.weight", model_ffn_}, {hf + "mlp.up_proj.weight", model_ffn_}},
                    true,
                    layer};
  specs[kDown] = {p + "mlp.down.weight", {hidden_, model_ffn_}, {{hf + "mlp.down_proj.weight", hidden_}}, true, layer,
                  true};
  specs[kGateUp].tensor_parallel = TensorParallelSplit::Rows;  // column-parallel: the rank's F/T
  specs[kDown].tensor_parallel = TensorParallelSplit::Columns;   // row-parallel
  return specs;
}

void SwiGluFeedForward::lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode,
                                int num_layers) {
  const int64_t n = shape.tokens(), rows = shape.stream_rows(), tp = shape.tensor_parallel;
  FORGE_CHECK(tp >= 1 && model_ffn_ % tp == 0,
              "tensor parallelism over {} ranks splits the feed-forward's {} columns, which it does not divide", tp,
              model_ffn_);
  ffn_ = model_ffn_ / tp;
  auto act = [&](Shape s) { return layout.take(std::move(s), shape.dtype); };
  // The gate/up GEMM output is costly to recompute; the normalized input and the SwiGLU
  // output are not.
  auto costly = [&](Activations& a) {
    a.rstd = layout.take({rows}, DType::F32);
    a.gate_up = act({n, 2 * ffn_});
  };
  auto cheap = [&](Activations& a) {
    a.normed = act({rows, hidden_});
    a.swiglu = act({n, ffn_});
  };
  layers_ = lay_out_layers<Activations>(num_layers, mode, costly, cheap);
  d_swiglu_ = act({n, ffn_});
  d_gate_up_ = act({n, 2 * ffn_});
  edges_.lay_out(layout, shape, hidden_);
}

void SwiGluFeedForward::forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_, edges_.norm_consumer(w.linear(kGateUp)));
  // NOTE [Tensor parallelism]: every rank's rows into the column-parallel gate/up.
  edges_.project_in(a.gate_up, a.normed, w.linear(kGateUp));
  swiglu_forward(a.swiglu, a.gate_up, out ? &w.linear(kDown) : nullptr);
  if (!out) return;
  edges_.project_out(*out, a.swiglu, w.linear(kDown), x);
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
  // out = x + swiglu @ down^T; under tensor parallelism every rank's rows of dL/dout feed
  // the row-parallel down's backward (NOTE [Tensor parallelism]).
  edges_.project_out_backward(d_swiglu_, grads.linear(kDown), d_stream, a.swiglu, w.linear(kDown), overwrite);
  swiglu_backward(d_gate_up_, d_swiglu_, a.gate_up, &w.linear(kGateUp));
  edges_.normed_projection_backward(d_hidden, grads.linear(kGateUp), d_gate_up_, a.normed, w.linear(kGateUp), overwrite,
                                    d_stream, grads.tensor(kNorm), x, w.tensor(kNorm), a.rstd);
}

}  // namespace forge
