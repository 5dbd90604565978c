#include "model/self_attention.h"

#include <cmath>

#include <fmt/format.h>

#include "model/sequence_parallel.h"
#include "ops/linear.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"

namespace forge {

SelfAttention::SelfAttention(const ModelConfig& config)
    : hidden_(config.hidden_size),
      model_heads_(config.num_heads),
      model_kv_heads_(config.num_kv_heads),
      heads_(config.num_heads),
      kv_heads_(config.num_kv_heads),
      head_dim_(config.resolved_head_dim()),
      eps_(static_cast<float>(config.norm_eps)),
      rotary_(config.resolved_head_dim(), config.rope_theta, config.rope_scaling),
      attention_{config.num_heads, config.num_kv_heads, config.sliding_window,
                 1.0f / std::sqrt(static_cast<float>(config.resolved_head_dim())), config.resolved_head_dim()} {}

std::vector<ParamSpec> SelfAttention::param_specs(int layer) const {
  const std::string p = fmt::format("layers.{}.", layer), hf = fmt::format("model.layers.{}.", layer);
  const int64_t q = model_heads_ * head_dim_, kv = model_kv_heads_ * head_dim_;
  std::vector<ParamSpec> specs(3);
  specs[kNorm] = {p + "attn_norm.weight", {hidden_}, {{hf + "input_layernorm.weight", hidden_}}, false, layer};
  specs[kQkv] = {p + "attention.qkv.weight",
                 {q + 2 * kv, hidden_},
                 {{hf + "self_attn.q_proj.weight", q}, {hf + "self_attn.k_proj.weight", kv},
                  {hf + "self_attn.v_proj.weight", kv}},
                 true,
                 layer};
  specs[kOut] = {p + "attention.o.weight", {hidden_, q}, {{hf + "self_attn.o_proj.weight", hidden_}}, true, layer,
                 true};
  specs[kQkv].tensor_parallel = TensorParallelSplit::Rows;     // column-parallel: the rank's heads
  specs[kOut].tensor_parallel = TensorParallelSplit::Columns;  // row-parallel
  return specs;
}

void SelfAttention::lay_out(ArenaLayout& layout, const StepShape& shape, ActivationCheckpoint mode, int num_layers) {
  shape_ = shape;
  const int64_t n = shape.tokens(), rows = shape.stream_rows(), b = shape.local_batch(), t = shape.local_seq_len();
  const int64_t tp = shape.tensor_parallel;
  FORGE_CHECK(tp >= 1 && model_heads_ % tp == 0 && model_kv_heads_ % tp == 0,
              "tensor parallelism over {} ranks splits {} query and {} key/value heads, which it does not divide", tp,
              model_heads_, model_kv_heads_);
  heads_ = model_heads_ / tp;
  kv_heads_ = model_kv_heads_ / tp;
  attention_.num_q_heads = heads_;
  attention_.num_kv_heads = kv_heads_;
  auto act = [&](Shape s) { return layout.take(std::move(s), shape.dtype); };
  auto stat = [&](Shape s) { return layout.take(std::move(s), DType::F32); };
  // The GEMM and attention outputs (and the statistics beside them) are costly to
  // recompute; the normalized input is not.
  auto costly = [&](Activations& a) {
    a.rstd = stat({rows});
    a.qkv = act({b, t, heads_ + 2 * kv_heads_, head_dim_});
    a.out = act({b, t, heads_, head_dim_});
    a.lse = stat({b, heads_, t});
  };
  auto cheap = [&](Activations& a) { a.normed = act({rows, hidden_}); };
  layers_ = lay_out_layers<Activations>(num_layers, mode, costly, cheap);
  d_out_ = act({n, heads_ * head_dim_});
  d_qkv_ = act({b, t, heads_ + 2 * kv_heads_, head_dim_});
  edges_.lay_out(layout, shape, hidden_);
  if (shape.context_parallel > 1)
    cp_attention_.lay_out(layout, shape, heads_, kv_heads_, head_dim_,
                          cp_ ? cp_->rotate_method() : shape.context_parallel_rotate);
}

void SelfAttention::prepare(const StepShape& shape, Device device) {
  rotary_.prepare(shape.seq_len, device);
  if (cp_) cp_attention_.prepare(*cp_, shape, device);
}

const Tensor* SelfAttention::positions() const { return cp_ ? &cp_attention_.positions() : rotary_.positions(); }

void SelfAttention::set_sequence_layout(const SequenceLayout* layout) {
  if (cp_) cp_attention_.set_layout(*cp_, layout, attention_);  // NOTE [Context parallelism]
  else rotary_.set_layout(layout, attention_);
}

void SelfAttention::forward(int layer, const ComponentWeights& w, const Tensor& x, const Tensor* out) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  const int64_t n = shape_.tokens();
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_, edges_.norm_consumer(w.linear(kQkv)));
  // NOTE [Tensor parallelism]: every rank's rows into the column-parallel qkv.
  edges_.project_in(a.qkv.view({n, (heads_ + 2 * kv_heads_) * head_dim_}), a.normed, w.linear(kQkv));
  rope_forward(a.qkv, heads_ + kv_heads_, rotary_.cos(), rotary_.sin(), positions());
  if (cp_) cp_attention_.forward(*cp_, layer, a.out, a.lse, a.qkv, attention_);
  else attention_forward(a.out, a.lse, a.qkv, attention_, rotary_.segments());
  if (!out) return;
  edges_.project_out(*out, a.out.view({n, heads_ * head_dim_}), w.linear(kOut), x);
}

void SelfAttention::recompute_selective(int layer, const ComponentWeights& w, const Tensor& x) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  rmsnorm_forward(a.normed, a.rstd, x, w.tensor(kNorm), eps_);
}

void SelfAttention::backward(int layer, const ComponentWeights& w, const ComponentWeights& grads, bool overwrite,
                             const Tensor& x, const Tensor& d_stream, const Tensor& d_hidden) {
  Activations& a = layers_.at(static_cast<size_t>(layer));
  const int64_t n = shape_.tokens();
  if (overwrite) grads.tensor(kNorm).fill_zero();  // the norm's backward adds
  // out = x + attention_out @ o^T; under tensor parallelism every rank's rows of dL/dout
  // feed the row-parallel o's backward (NOTE [Tensor parallelism]).
  edges_.project_out_backward(d_out_, grads.linear(kOut), d_stream, a.out.view({n, heads_ * head_dim_}),
                              w.linear(kOut), overwrite);
  const Tensor d_attended = d_out_.view(a.out.shape());
  if (cp_) cp_attention_.backward(*cp_, layer, d_qkv_, d_attended, a.qkv, a.out, a.lse, attention_);
  else attention_backward(d_qkv_, d_attended, a.qkv, a.out, a.lse, attention_, rotary_.segments());
  rope_backward(d_qkv_, heads_ + kv_heads_, rotary_.cos(), rotary_.sin(), positions());
  const Tensor d_qkv = d_qkv_.view({n, (heads_ + 2 * kv_heads_) * head_dim_});
  edges_.normed_projection_backward(d_hidden, grads.linear(kQkv), d_qkv, a.normed, w.linear(kQkv), overwrite, d_stream,
                                    grads.tensor(kNorm), x, w.tensor(kNorm), a.rstd);
}

}  // namespace forge
